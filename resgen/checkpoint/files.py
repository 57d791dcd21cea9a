"""Safetensors weight files of a Hugging Face folder: discovery, header checks, lazy reads.

The headers are parsed and checked here (8-byte little-endian length, a JSON object, every
entry's dtype, shape and byte range inside the file) before safetensors touches the data, so a
damaged or foreign file is reported as a CheckpointError naming the file and the tensor, not as
a SafetensorError or a JSONDecodeError. Reading goes through safetensors' memory map, one tensor
at a time (nothing is held that the caller does not keep).

Folder layout (the Hugging Face convention): model.safetensors.index.json with a weight_map
(tensor -> shard file) and the shards it names (model-00001-of-0000N.safetensors), or a single
model.safetensors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from .errors import CheckpointError

__all__ = ["TensorInfo", "DTYPES", "read_header", "discover", "TensorReader", "LazyTensors",
           "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
_MAX_HEADER = 100 * 1024 * 1024        # safetensors' own limit

# safetensors dtype code -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1),
    "I16": (torch.int16, 2), "I32": (torch.int32, 4), "I64": (torch.int64, 8),
    "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4),
    "F64": (torch.float64, 8), "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
for _code, _name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _name):
        DTYPES[_code] = (getattr(torch, _name), {"U16": 2, "U32": 4, "U64": 8}.get(_code, 1))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it (no data read)."""

    name: str
    file: Path
    dtype: str                  # safetensors code: "U8", "F8_E4M3", "F32", "BF16", ...
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check one safetensors header -> ({name: TensorInfo}, metadata)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError("not a safetensors file (shorter than the 8-byte header "
                                      "length)", file=path)
            n = int.from_bytes(head, "little")
            if n < 2 or n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"not a safetensors file (header length {n} does not fit "
                                      f"a file of {size} bytes)", file=path)
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=path) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError("not a safetensors file (its header is not JSON)",
                              file=path) from None
    if not isinstance(header, dict):
        raise CheckpointError("not a safetensors file (its header is not a JSON object)",
                              file=path)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise CheckpointError("malformed safetensors metadata (not str -> str)", file=path)
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, ent in header.items():
        if not isinstance(ent, dict):
            raise CheckpointError("malformed header entry", file=path, tensor=name)
        dtype, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if dtype not in DTYPES:
            raise CheckpointError(f"unsupported dtype {dtype!r}", file=path, tensor=name)
        if (not isinstance(shape, list) or
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in shape)):
            raise CheckpointError(f"malformed shape {shape!r}", file=path, tensor=name)
        if (not isinstance(offs, list) or len(offs) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise CheckpointError(f"malformed data_offsets {offs!r}", file=path, tensor=name)
        a, b = offs
        want = math.prod(shape) * DTYPES[dtype][1]
        if not 0 <= a <= b <= data_len:
            raise CheckpointError(f"data [{a}, {b}) lies outside the file's {data_len} data "
                                  "bytes (truncated file?)", file=path, tensor=name)
        if b - a != want:
            raise CheckpointError(f"holds {b - a} bytes, its {dtype} shape {shape} needs "
                                  f"{want}", file=path, tensor=name)
        out[name] = TensorInfo(name, path, dtype, tuple(shape))
    return out, meta


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError("not UTF-8 text", file=path) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not JSON ({e.msg} at line {e.lineno})", file=path) from None
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=path) from None


def discover(folder: Path) -> dict[str, TensorInfo]:
    """Every weight tensor of a Hugging Face folder by name (headers checked, no data read)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        doc = _read_json(index)
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in wmap.items()):
            raise CheckpointError("has no weight_map of tensor name -> shard file", file=index)
        shards: dict[str, list[str]] = {}
        for name, shard in wmap.items():
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(f"names the shard {shard!r}, which is not a file name in "
                                      "the folder", file=index, tensor=name)
            shards.setdefault(shard, []).append(name)
        out: dict[str, TensorInfo] = {}
        for shard, names in shards.items():
            path = folder / shard
            if not path.is_file():
                raise CheckpointError(f"missing shard {shard} (named by {INDEX_FILE} for "
                                      f"{len(names)} tensors, e.g. {names[0]!r})", file=path)
            infos, _ = read_header(path)
            extra = sorted(set(infos) - set(names))
            if extra:
                # vLLM reads every tensor of the listed files, transformers only the listed
                # ones: a checkpoint where they would differ is malformed.
                raise CheckpointError(f"holds {len(extra)} tensor(s) that {INDEX_FILE} does "
                                      "not list", file=path, tensor=extra[0])
            for name in names:
                if name not in infos:
                    raise CheckpointError(f"{INDEX_FILE} places this tensor in {shard}, which "
                                          "does not hold it", file=path, tensor=name)
                out[name] = infos[name]
        return out
    single = folder / SINGLE_FILE
    if single.is_file():
        return read_header(single)[0]
    shards = sorted(p.name for p in folder.glob("*.safetensors") if _SHARD.match(p.name))
    if shards:
        raise CheckpointError(f"sharded weights ({', '.join(shards[:3])}"
                              f"{', ...' if len(shards) > 3 else ''}) without their "
                              f"{INDEX_FILE}", file=folder)
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE}: PyTorch pickle weights "
                              "(.bin / .pt) are not read; convert them to safetensors",
                              file=folder)
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in the folder", file=folder)


class TensorReader:
    """Reads tensors described by TensorInfo through safetensors (one open handle per file)."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def read(self, info: TensorInfo) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            h = self._handles.get(info.file)
            if h is None:
                h = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            return h.get_tensor(info.name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read: {e}", file=info.file, tensor=info.name) from None


class LazyTensors(Mapping[str, torch.Tensor]):
    """A read-only name -> tensor mapping whose values are produced on access.

    sources: name -> a zero-argument function returning the tensor (typically a read from a
    safetensors file), so iterating the keys or asking for one tensor never loads the others;
    every access produces the tensor again (keep what you need).
    infos: name -> TensorInfo for the entries read from a file (their dtype / shape without
    reading: `info(name)`).
    """

    def __init__(self, sources: Mapping[str, Callable[[], torch.Tensor]],
                 infos: Mapping[str, TensorInfo] | None = None) -> None:
        self._sources = dict(sources)
        self._infos = dict(infos or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def info(self, name: str) -> TensorInfo | None:
        """The header entry of a tensor read from a file (None for computed entries)."""
        if name not in self._sources:
            raise KeyError(name)
        return self._infos.get(name)

    def __repr__(self) -> str:
        return f"LazyTensors({len(self)} tensors)"
