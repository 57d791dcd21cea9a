"""Read kernel resource usage from a cubin's ELF `.nv.info.<kernel>` sections.

Each entry is (format: u8, attribute: u8, size: u16, payload). For the attributes used here the
payload is (symbol index: u32, value: u32). EIATTR_REGCOUNT (0x2f) is the register count per
thread; EIATTR_FRAME_SIZE (0x11) is the per-thread stack frame in bytes, where spilled registers
and local arrays live (0 means no local memory traffic).
"""

from __future__ import annotations

import struct

__all__ = ["kernel_resources"]

_EIATTR = {0x2F: "registers", 0x11: "local_bytes", 0x12: "min_stack_bytes"}


def _sections(elf: bytes):
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stroff, strsize = heads[shstrndx][4], heads[shstrndx][5]
    names = elf[stroff:stroff + strsize]
    for h in heads:
        end = names.index(b"\0", h[0])
        yield names[h[0]:end].decode(), elf[h[4]:h[4] + h[5]]


def kernel_resources(cubin: bytes) -> dict[str, int]:
    """{"registers", "local_bytes", "min_stack_bytes"} of the cubin's kernel (first seen wins)."""
    out: dict[str, int] = {}
    for name, data in _sections(cubin):
        if name != ".nv.info" and not name.startswith(".nv.info."):
            continue
        pos = 0
        while pos + 4 <= len(data):
            fmt, attr, size = struct.unpack_from("<BBH", data, pos)
            if fmt == 0x04 and attr in _EIATTR and size >= 8:
                out.setdefault(_EIATTR[attr], struct.unpack_from("<I", data, pos + 8)[0])
            pos += 4 + (size if fmt == 0x04 else 0)
    return out
