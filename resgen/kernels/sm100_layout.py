"""The sm_100a operand layouts and TMEM fragment maps every Blackwell family shares (pure integer
math on Python ints; the functions a kernel calls with device values use only +, *, //, % with
Python-int divisors, so they work on CuTe DSL integers too).

Scale factors (SF) live in the tcgen05 block-scaled layout (CUTLASS BlockScaledBasicChunk, the
layout CUTLASS's tile_atom_to_shape_SF builds): 512-byte atoms of 128 rows x 4 SF columns,
    offset(r, b) = ((r // 128) * (SFC // 4) + b // 4) * 512 + (r % 32) * 16
                   + ((r // 32) % 4) * 4 + b % 4
for row r and SF column b = k // V (V = 16 NVFP4 E4M3, 32 MXFP4 E8M0; SFC = SF columns, a
multiple of 4). The MMA's scale-factor tile is always 128 rows, so an operand whose MMA tile has
fewer rows (8..64 activation rows) is stored "tile-padded": the rows of tile z start at SF row
128 z (sf_row).

Activation rows (what the quantizer writes; R rows for T tokens):
    plain     row t = token t (plain W4A4 and K-Ext, whose extension is extra K columns)
    row_pair  row 2t = base of token t, 2t + 1 = its residue (M-Ext)
    tile8     per 16 rows: 8 base rows (tokens 8b..8b+7), then their 8 residue rows (M-Ext)

TMEM loads (tcgen05.ld.sync.aligned.<shape>.x<rep>.b32; a warp reaches only the 32 lanes
32 (warp % 4) .. + 31 of its sub-partition): register r of thread t holds, relative to the
instruction's (lane, column) address (tmem_frag; the PTX ISA fragment layouts, CUTLASS
SM100_TMEM_LOAD_* traits, checked against CuTe DSL's own partition in the tests):
    32x32b   lane t,               column r                         (rep columns, 32 lanes)
    16x256b  lane t//4 + 8 h,      column 8 q + 2 (t % 4) + j       (r = j + 2 h + 4 q)
    16x128b  lane t//4 + 8 h,      column 4 q + t % 4               (r = h + 2 q)
"""

from __future__ import annotations

from typing import Any

__all__ = ["MMA_K", "SF_ATOM_ROWS", "SF_ATOM_COLS", "SF_ATOM_BYTES", "ROW_LAYOUTS",
           "TMEM_SHAPES", "TMEM_COLS", "SMEM_BYTES", "pow2_ceil", "round_up", "sf_vec",
           "sf_cols", "sf_offset", "sf_row", "sf_rows", "act_rows", "act_row",
           "token_of_row", "tmem_frag", "tmem_span"]

MMA_K = 64                 # K of one block-scaled FP4 MMA instruction
SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS
ROW_LAYOUTS = ("plain", "row_pair", "tile8")
TMEM_SHAPES = ("32x32b", "16x256b", "16x128b")
TMEM_COLS = 512            # tensor memory columns per SM (128 lanes x 512 x 32 bit)
SMEM_BYTES = 227 * 1024    # dynamic shared memory per CTA (sm_100)


def pow2_ceil(v: int) -> int:
    """The smallest power of two >= v (v >= 1)."""
    return 1 << max(0, int(v) - 1).bit_length()


def round_up(v: int, m: int) -> int:
    return -(-int(v) // m) * m


def sf_vec(fmt: str) -> int:
    """Elements per scale factor: 16 (NVFP4, E4M3) or 32 (MXFP4, E8M0)."""
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"unknown FP4 format {fmt!r}")
    return 16 if fmt == "nvfp4" else 32


def sf_cols(kp: int, fmt: str) -> int:
    """SF columns of a row of kp elements (a multiple of 4: whole atoms)."""
    return round_up(kp // sf_vec(fmt), SF_ATOM_COLS)


def sf_offset(r: Any, b: Any, cols: int) -> Any:
    """Byte offset of the scale factor of row r, SF column b, in an SF tensor of `cols` SF
    columns (tcgen05 block-scaled atom layout, see the module docstring)."""
    return (((r // SF_ATOM_ROWS) * (cols // SF_ATOM_COLS) + b // SF_ATOM_COLS) * SF_ATOM_BYTES
            + (r % 32) * 16 + ((r // 32) % 4) * 4 + b % SF_ATOM_COLS)


def sf_row(row: Any, tile_rows: int) -> Any:
    """The SF row of operand row `row` for an MMA tile of tile_rows rows (tile-padded when the
    tile has fewer than 128 rows: tile z's rows start at SF row 128 z)."""
    if tile_rows >= SF_ATOM_ROWS:
        return row
    return (row // tile_rows) * SF_ATOM_ROWS + row % tile_rows


def sf_rows(rows: int, tile_rows: int) -> int:
    """Rows an SF tensor must have for `rows` operand rows (whole 128-row atoms)."""
    if tile_rows >= SF_ATOM_ROWS:
        return round_up(max(rows, 1), SF_ATOM_ROWS)
    return -(-max(rows, 1) // tile_rows) * SF_ATOM_ROWS


def act_rows(tokens: int, layout: str) -> int:
    """Activation operand rows for `tokens` tokens in `layout`."""
    if layout == "plain":
        return tokens
    if layout == "row_pair":
        return 2 * tokens
    if layout == "tile8":
        return 16 * -(-tokens // 8)
    raise ValueError(f"unknown activation row layout {layout!r}; known: {ROW_LAYOUTS}")


def act_row(token: Any, residue: bool, layout: str) -> Any:
    """The operand row of token's base (residue=False) or residue row."""
    if layout == "plain":
        if residue:
            raise ValueError("the plain layout has no residue rows")
        return token
    if layout == "row_pair":
        return 2 * token + (1 if residue else 0)
    if layout == "tile8":
        return (token // 8) * 16 + token % 8 + (8 if residue else 0)
    raise ValueError(f"unknown activation row layout {layout!r}")


def token_of_row(row: Any, layout: str) -> tuple[Any, Any]:
    """(token, is_residue 0/1) of operand row `row`."""
    if layout == "plain":
        return row, 0
    if layout == "row_pair":
        return row // 2, row % 2
    if layout == "tile8":
        return (row // 16) * 8 + row % 8, (row % 16) // 8
    raise ValueError(f"unknown activation row layout {layout!r}")


def tmem_frag(shape: str, t: Any, r: int) -> tuple[Any, Any]:
    """(lane, column) offsets of register r of thread t (0..31) of one tcgen05.ld.<shape>
    relative to its TMEM address (the repetition count only sets how many registers exist)."""
    if shape == "32x32b":
        return t, r
    if shape == "16x256b":
        j, h, q = r % 2, (r // 2) % 2, r // 4
        return t // 4 + 8 * h, 8 * q + 2 * (t % 4) + j
    if shape == "16x128b":
        h, q = r % 2, r // 2
        return t // 4 + 8 * h, 4 * q + t % 4
    raise ValueError(f"unknown TMEM load shape {shape!r}; known: {TMEM_SHAPES}")


_REGS_PER_REP = {"32x32b": 1, "16x256b": 4, "16x128b": 2}


def tmem_span(shape: str, rep: int) -> tuple[int, int, int]:
    """(lanes, columns, registers per thread) one tcgen05.ld.<shape>.x<rep> covers."""
    if shape == "32x32b":
        return 32, rep, rep
    if shape == "16x256b":
        return 16, 8 * rep, 4 * rep
    if shape == "16x128b":
        return 16, 4 * rep, 2 * rep
    raise ValueError(f"unknown TMEM load shape {shape!r}; known: {TMEM_SHAPES}")
