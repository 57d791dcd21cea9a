"""Index maps of the Hopper ResAttn decode kernel: ONE definition shared by the CuTe DSL
template (device code), the host wrappers and the CPU emulator (tests, accuracy study).

Every function works on Python ints, on torch integer tensors (the emulator evaluates them for
all 32 lanes at once) and on CuTe DSL integers (the kernel evaluates them at trace time or at
run time): only +, *, >>, & and comparisons are used, never Python branches on a lane value.

Notation. A warp computes mma.sync tiles; lane = 4 g + t (g = lane >> 2 "group", t = lane & 3
"thread in group"). Fragment layouts (PTX ISA, m16n8k16 .f16 and m16n8k32 .e4m3):
    A m16 x k16:  a0a1 (row g,   k 2t..2t+1)   a2a3 (row g+8, k 2t..2t+1)
                  a4a5 (row g,   k 2t+8..+9)   a6a7 (row g+8, k 2t+8..+9)
    B k16 x n8:   b0b1 (k 2t..2t+1, col g)     b2b3 (k 2t+8..+9, col g)
    C m16 x n8:   c0c1 (row g, col 2t..2t+1)   c2c3 (row g+8, col 2t..2t+1)
    A m16 x k32 (8-bit): reg0 (row g, k 4t..4t+3) reg1 (row g+8, same) reg2 (row g, k 4t+16..)
                         reg3 (row g+8, k 4t+16..);  B k32 x n8: reg0 (k 4t.., col g) reg1 (k 4t+16..)

QK (operands swapped: keys on the wide M side, queries on the narrow N side)
    A = K chunk (16 keys x 16 head dims per k-step), B = Q^T (16 dims x 8 query columns).
    Lane (g, t) loads, for keys g and g+8 of each 16-key tile, the D/8 bytes starting at byte
    t * D/8 of the key row, i.e. head dims (D/4) t .. (D/4) t + D/4 - 1 (D/32 words). A word of
    8 codes decodes into four f16x2 registers R0..R3 holding dims (0, 2), (4, 6), (1, 3),
    (5, 7) of the word (even dims come out of one byte-parallel decode, odd dims out of
    another). k-step kk uses word u = kk >> 1: a0a1 = R_{2v}, a4a5 = R_{2v+1} (v = kk & 1). So
    MMA k-slot s of k-step kk is head dim k_slot_dim(kk, s, D);
    the query operand is placed with the same map, which makes the product the exact dot product.
Query columns ("packing")
    pair:  column 2j = FP4 base of head j, 2j+1 = its residue (n-tile i holds heads 4i..4i+3);
           the fold of the two products is c0 + c1 (and c2 + c3) inside one lane.
    dense: column j = head j (plain NVFP4-KV only; no residue).
    stack: ResAttn on dense's layout: operand tile 0 holds the FP4 bases of heads 0..7
           (column j = head j), operand tile 1 their residues; each k-step runs one MMA per
           operand tile into two accumulator tiles of the same layout (two independent MMA
           chains), added element by element in FP32 before the softmax (the fold). Pair's
           MMA count at G = 8 with dense's score registers and probability exchange.
Score registers: after the fold a lane holds scores of R <= 2 heads for keys g and g+8 of each
    16-key tile: pair: register r = n-tile, head 4r + t; dense and stack: register r, head
    2t + r.
PV (operands swapped again: head dims on M, query heads on N)
    A = V^T (16 head dims x 16 keys), B = P^T (16 keys x 8 columns), C = O^T.
    PV column c holds head pv_col_head(c) = score-register head of (t = c >> 1, r = c & 1), so a
    lane's output columns 2t, 2t+1 are exactly the heads whose softmax statistics it owns.
    k-slot s of a PV step is key pv_slot_key(s) of the 16-key tile; with that order the
    probabilities a lane needs arrive from two lanes only (p_source_lanes).
    Lane (g, t) loads V for keys t + 4j of the chunk, bytes g * D/16 .. of each key row: head
    dims (D/8) g .. (D/8) g + D/8 - 1. M-tile mt: row g = dim (D/8) g + 2 mt, row g+8 = +1.
"""

from __future__ import annotations

__all__ = [
    "lane_g", "lane_t", "k_slot_dim", "k_lane_dims", "k_lane_keys", "v_lane_keys",
    "v_row_dim", "pv_slot_key", "pv_slot_key_fp8", "score_head", "pv_col_head",
    "p_source_lanes", "qk_col_head", "qk_col", "n_qk_tiles", "n_acc_tiles", "n_score_regs",
    "split_range", "chunk_range", "warp_chunks", "smem_bytes", "SMEM_LIMIT",
]

SMEM_LIMIT = 48 * 1024       # static shared memory per CTA without an opt-in attribute


def lane_g(lane):
    return lane >> 2


def lane_t(lane):
    return lane & 3


# ----------------------------------------------------------------------------- QK


def k_slot_dim(kk, s, d: int):
    """Head dim at MMA k-slot s (0..15) of QK k-step kk (0 .. d/16 - 1).

    Word u = kk >> 1 of the lane's K bytes decodes to R0 = dims (0, 2), R1 = (4, 6),
    R2 = (1, 3), R3 = (5, 7) of the word; k-step kk takes a0a1 = R_{2v}, a4a5 = R_{2v+1}."""
    t = (s & 7) >> 1
    half = s & 1
    hi = s >> 3
    u = kk >> 1
    v = kk & 1
    return (d // 4) * t + 8 * u + 4 * hi + v + 2 * half


def k_lane_dims(t, d: int):
    """First head dim of the K bytes lane (., t) loads (it loads d/8 bytes = d/4 dims)."""
    return (d // 4) * t


def k_lane_keys(g, z):
    """Keys (within the chunk) lane (g, .) loads for 16-key tile z: rows g and g + 8."""
    return 16 * z + g, 16 * z + g + 8


def n_qk_tiles(group: int, packing: str) -> int:
    """n8 query operand tiles of the QK product for a GQA group of `group` (<= 8) heads."""
    if packing == "pair":
        return (2 * group + 7) // 8
    if packing == "stack":
        return 2 * ((group + 7) // 8)
    return (group + 7) // 8


def n_acc_tiles(group: int, packing: str) -> int:
    """n8 accumulator tiles of the QK product (stack: both operand tiles feed one)."""
    nt = n_qk_tiles(group, packing)
    return nt // 2 if packing == "stack" else nt


def qk_col_head(i: int, c: int, packing: str) -> tuple[int, int]:
    """(head, kind) of query column c of QK operand tile i; kind 0 = base, 1 = residue."""
    if packing == "pair":
        return 4 * i + (c >> 1), c & 1
    if packing == "stack":
        return c, i
    return 8 * i + c, 0


def qk_col(head, kind, packing: str):
    """Query operand column (8 i + c) of (head, kind): qk_col_head's inverse."""
    if packing == "pair":
        return 2 * head + kind
    if packing == "stack":
        return head + 8 * kind
    return head


def n_score_regs(group: int, packing: str) -> int:
    """Score registers per lane (heads a lane owns): 1 or 2."""
    if packing == "pair":
        return n_qk_tiles(group, packing)
    return 2


def score_head(t, r, packing: str):
    """Head of score register r of lane (., t)."""
    if packing == "pair":
        return 4 * r + t
    return 2 * t + r


# ----------------------------------------------------------------------------- PV


def v_lane_keys(t, kc: int):
    """Keys (within the chunk) lane (., t) loads V for: t + 4 j, j = 0 .. kc/4 - 1."""
    return [t + 4 * j for j in range(kc // 4)]


def v_row_dim(mt, row, d: int):
    """Head dim of O^T / V^T row `row` (0..15, row = g or g + 8) of PV m-tile mt."""
    return (d // 8) * (row & 7) + 2 * mt + (row >> 3)


def pv_slot_key(s):
    """Key (within its 16-key tile) at k-slot s (0..15) of a PV m16n8k16 step."""
    t = (s & 7) >> 1
    return t + 8 * (s & 1) + 4 * (s >> 3)


def pv_slot_key_fp8(s):
    """Key (within the 32-key chunk) at k-slot s (0..31) of a PV m16n8k32 e4m3 step."""
    t = (s & 15) >> 2
    return t + 8 * (s & 3) + 4 * (s >> 4)


def pv_col_head(c: int, packing: str) -> int:
    """Head held by PV output column c (0..7)."""
    return score_head(c >> 1, c & 1, packing)


def p_source_lanes(g, t):
    """Lanes whose packed probabilities receiver (g, t) needs: (slots 2t..2t+1, slots
    2t+8..2t+9) of the f16 step, or (reg0, reg1) of the e4m3 step; register r = g & 1."""
    lo = 4 * t + (g >> 1)
    return lo, lo + 16


# ----------------------------------------------------------------------------- work split


def split_range(seq_len, split, num_splits, page_size: int):
    """Pages [p0, p1) of a sequence that split `split` of `num_splits` handles (p1 <= p0 when
    it has none): contiguous, ceil(pages / num_splits) pages each."""
    pages = (seq_len + page_size - 1) // page_size
    per = (pages + num_splits - 1) // num_splits
    p0 = split * per
    p1 = p0 + per
    return p0, p1, pages


def chunk_range(seq_len, split, num_splits, page_size: int, kc: int):
    """Chunks [q0, q1) of kc keys that a split handles (global chunk index in the sequence)."""
    p0, p1, pages = split_range(seq_len, split, num_splits, page_size)
    cpp = page_size // kc
    nchunks = (seq_len + kc - 1) // kc
    q0 = p0 * cpp
    q1 = p1 * cpp
    return q0, q1, nchunks


def warp_chunks(q0, end, warp, num_warps: int):
    """Chunks warp `warp` processes: q0 + warp + num_warps * c for c < the returned count
    (end = min(q1, chunks of the sequence); a count <= 0 means none)."""
    return (end - q0 - warp + num_warps - 1) // num_warps


# ----------------------------------------------------------------------------- E2M1 -> f16 bits


def h_odd(w):
    """Byte-parallel decode of the HIGH nibble of each byte of a 32-bit word: per byte the high
    byte of the f16 E2M1 x 2^-14 (sign to bit 7, exponent+mantissa bits to 3..1)."""
    return (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E)


def h_even(w):
    """The same for the LOW nibble of each byte (sign bit 3 -> 7, bits 0..2 -> 1..3)."""
    return ((w << 4) & 0x80808080) | ((w << 1) & 0x0E0E0E0E)


def sel_f16_pair(i: int, j: int) -> int:
    """prmt selector building an f16x2 from bytes i (low half) and j (high half) of the first
    operand, with zero low bytes taken from a zero second operand (bytes 4..7)."""
    return (j << 12) | (4 << 8) | (i << 4) | 4


# K word -> R0..R3: (H_even bytes 0,1), (H_even 2,3), (H_odd 0,1), (H_odd 2,3) = dims
# (0,2), (4,6), (1,3), (5,7) of the word.
K_WORD_REGS = ((0, 0, 1), (0, 2, 3), (1, 0, 1), (1, 2, 3))      # (odd?, lo byte, hi byte)
# V: x = prmt(w_a, w_b, 0x5410) holds bytes 0,1 of key a then bytes 0,1 of key b (0x7632: bytes
# 2,3). From x: f16x2 (a, b) of word dims (0, 1, 2, 3) + 4 * (selector == 0x7632):
V_PAIR_REGS = ((0, 0, 2), (1, 0, 2), (0, 1, 3), (1, 1, 3))      # dims +0, +1, +2, +3
V_INTERLEAVE = (0x5410, 0x7632)


# ----------------------------------------------------------------------------- shared memory


def smem_bytes(head_dim: int, group: int, num_warps: int, packing: str) -> dict[str, int]:
    """Shared memory regions of the decode kernel (bytes, 16-byte multiples): query operand
    columns (f16), per-head alpha, the warps' (m, l, O) partials, the last-CTA flag."""
    def r16(n):
        return (n + 15) // 16 * 16
    nt = n_qk_tiles(group, packing)
    return {
        "qs": r16(8 * nt * head_dim * 2),
        "alpha": r16(4 * 8 * nt + 32),
        "wm": r16(4 * num_warps * group),
        "wl": r16(4 * num_warps * group),
        "wo": r16(4 * num_warps * group * head_dim),
        "flag": 16,
    }
