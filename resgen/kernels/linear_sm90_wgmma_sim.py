"""Thread-level CPU simulation of the linear_sm90_wgmma kernels (the CPU tests' stand-in for an
H200), built on the same geometry (resgen.kernels.linear_sm90_wgmma_geom) the kernel template
uses.

simulate_launch: one launch, CTA by CTA: the weight records are read at the kernel's byte
    offsets and decoded with the kernel's bit operations (linear_sm90_wgmma_layout.
    fragment_values), the A fragments are placed with the wgmma register-fragment coordinates,
    the B tile is the TMA box (rows past `rows` read as zero, as TMA fills them), the
    accumulators are read back per lane with the accumulator coordinates, and the epilogue runs
    lane by lane: BF16 packing, the byte permutes, the xor-4 shuffle and the 32-bit stores at
    the addresses of WgGeometry.store_lane, predicated on token < m. Split-K: each slice's
    partial accumulators (FP32) over its chunk range, summed in split order as the tile's last
    CTA does.
SimulatedKernel: stands in for a compiled kernel: takes the launcher's raw pointers and ints,
    reads the tensors at those host addresses (CPU tensors) and writes simulate_launch's output
    there, so the launcher's argument order, sizes and alignments are checked end to end.
simulate_pipeline: the mbarrier protocol between the producer thread and the consumer
    warpgroups (stages, parities, releases), stepped in random interleavings: it checks that
    every consumer reads the chunk it expects, that no stage is overwritten while a consumer
    still holds it, and that the schedule never deadlocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .sm90_fp4_layout import epilogue_factor
from .linear_sm90_wgmma_geom import MEXT_SEL, PLAIN_SEL, WgGeometry
from .linear_sm90_wgmma_layout import WgWeight, fragment_values

__all__ = ["prmt", "cvt_bf16x2", "simulate_launch", "simulate_pipeline", "PipelineTrace",
           "SimulatedKernel"]

_M32 = 0xFFFFFFFF


def prmt(a: torch.Tensor, b: torch.Tensor, sel) -> torch.Tensor:
    """PTX prmt.b32 (default mode) on int64 tensors holding uint32 values; sel int or tensor."""
    sel = torch.as_tensor(sel, dtype=torch.int64)
    src = [(a >> (8 * k)) & 0xFF for k in range(4)] + [(b >> (8 * k)) & 0xFF for k in range(4)]
    stack = torch.stack(torch.broadcast_tensors(*src), dim=0)
    out = torch.zeros_like(stack[0])
    for k in range(4):
        nib = ((sel >> (4 * k)) & 7).expand_as(out)
        out |= torch.gather(stack, 0, nib.unsqueeze(0)).squeeze(0) << (8 * k)
    return out


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def cvt_bf16x2(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """cvt.rn.bf16x2.f32 of float32 tensors (lo in the low half) -> int64 uint32 values."""
    return _bf16_bits(lo) | (_bf16_bits(hi) << 16)


def _lane_ids():
    tid = torch.arange(128)
    q, lane = tid // 32, tid % 32
    return q, lane // 4, lane % 4


def _dense_block(frag_mb: torch.Tensor, kp: int) -> torch.Tensor:
    """float64 [64, Kp]: the A operand one m64 block presents to wgmma, assembled from the
    lanes' register fragments [nk, q, lane, j, slot] with WgGeometry.a_coord."""
    nk = frag_mb.shape[0]
    out = torch.zeros(64, nk, 64, dtype=torch.float64)
    q, g, t = _lane_ids()
    for j in range(4):
        for s in range(8):
            row, col = WgGeometry.a_coord(q, g, t, j, s)
            out[row, :, col] = frag_mb[:, q, g * 4 + t, j, s].T.double()
    return out.reshape(64, kp)


def _k_parts(geom: WgGeometry, tt: int, ct: int, rows: int, n: int, nk: int,
             ctas: int | None) -> list[tuple[int, int]]:
    """The column ranges [c0, c1) whose FP32 partial products make up tile (tt, ct), in the
    order the kernel sums them: split-K slices in split order, or (stream-K,
    linear_sm90_wgmma_streamk) the segments of the tile's contributors i0 .. i1."""
    if not getattr(geom, "streamk", 0):
        ks = nk * 64 // geom.split_k
        return [(z * ks, (z + 1) * ks) for z in range(geom.split_k)]
    if ctas is None:
        raise ValueError("a stream-K launch needs its CTA count")
    ntt, nct = geom.tile_grid(rows, n)
    t = ct * ntt + tt if geom.raster == "tok" else tt * nct + ct
    if geom.tile_coords(t, ntt, nct) != (tt, ct):
        raise AssertionError(f"tile {t} does not map back to ({tt}, {ct})")
    nq, units = nk // 2, geom.units(rows, n, nk)
    i0, i1 = geom.contributors(t, units, nq, ctas)
    parts = []
    for i in range(i0, i1 + 1):
        segs = [(q0, q1) for tile, q0, q1 in geom.segments(i, rows, n, nk, ctas) if tile == t]
        if len(segs) != 1:
            raise AssertionError(f"CTA {i} has {len(segs)} segments in tile {t}")
        parts.append((128 * segs[0][0], 128 * segs[0][1]))
    return parts


def simulate_launch(geom: WgGeometry, wt: WgWeight, xop: torch.Tensor, m: int, rows: int,
                    alpha_x: torch.Tensor | None, presum: bool = False,
                    ctas: int | None = None) -> torch.Tensor:
    """bf16 [m, N]: what one launch writes (NaN where nothing is written), on the CPU.

    xop: bf16 (presum: fp16, read as its values like any operand) [>= rows, Kp]; rows = m
    (plain / K-Ext / presum) or 2 m (M-Ext row pairs). presum: the A registers from the FP16
    decode (linear_sm90_wgmma_presum.fragment_values_f16) instead of the BF16 one. ctas: a
    stream-K launch's persistent CTAs (StreamKGeometry), whose segments make the partials."""
    if wt.packing != geom.packing or wt.fmt != geom.fmt:
        raise ValueError("weight packing/format does not match the geometry")
    n, kp = wt.out_features, wt.kp
    if presum:
        from .linear_sm90_wgmma_presum import fragment_values_f16

        frag = fragment_values_f16(wt.to("cpu"))
    else:
        frag = fragment_values(wt.to("cpu"))
    x = torch.zeros(-(-rows // geom.bn) * geom.bn, kp, dtype=torch.float64)
    x[:rows] = xop[:rows].to("cpu").double()               # TMA: rows >= `rows` read as zero
    fac = epilogue_factor(geom.fmt, None if alpha_x is None else alpha_x.cpu(),
                          wt.alpha.cpu()).float()
    out = torch.full((m * n,), 0x7FC0, dtype=torch.int64)  # bf16 NaN bits
    q, g, t = _lane_ids()
    odd = g % 2
    partner = q * 32 + (g ^ 1) * 4 + t                     # shfl.bfly 4
    gx, gy = geom.grid(rows, n)
    for bx in range(gx):
        for by in range(gy):
            tt, ct = geom.cta_tile(bx, by)
            xt = x[tt * geom.bn:(tt + 1) * geom.bn]        # [BN, Kp]
            for blk in range(geom.mb_cta):
                mb = ct * geom.mb_cta + blk
                a = _dense_block(frag[mb], kp)
                d = None
                for c0, c1 in _k_parts(geom, tt, ct, rows, n, kp // 64, ctas):  # FP32 partials
                    part = (a[:, c0:c1] @ xt[:, c0:c1].T).float()
                    d = part if d is None else d + part                  # [64, BN]
                r0 = mb * 64 + 16 * q + g
                for i in range(geom.bn // 8):
                    v = []
                    for e in range(4):
                        row, col = WgGeometry.acc_coord(q, g, t, 4 * i + e)
                        v.append(d[row, col])
                    tok_off, ch_off = WgGeometry.store_lane(g, t, i, geom.mext)
                    tok = tt * geom.tok_per_tile + tok_off
                    ch = r0 + ch_off
                    if geom.mext:
                        pk = cvt_bf16x2((v[0] + v[1]) * fac, (v[2] + v[3]) * fac)
                        stores = [(prmt(pk, pk[partner],
                                        WgGeometry.select(odd, MEXT_SEL["out"])), ch)]
                    else:
                        a = cvt_bf16x2(v[0] * fac, v[2] * fac)
                        b = cvt_bf16x2(v[1] * fac, v[3] * fac)
                        keep = prmt(a, b, WgGeometry.select(odd, PLAIN_SEL["keep"]))
                        send = prmt(a, b, WgGeometry.select(odd, PLAIN_SEL["send"]))
                        recv = send[partner]
                        stores = [(prmt(keep, recv, WgGeometry.select(odd, PLAIN_SEL["out0"])),
                                   ch),
                                  (prmt(keep, recv, WgGeometry.select(odd, PLAIN_SEL["out1"])),
                                   ch + 8)]
                    ok = tok < m
                    for val, c in stores:
                        if bool((c % 2 != 0).any()):
                            raise AssertionError("a 32-bit store at an odd channel")
                        idx = (tok * n + c)[ok]
                        out[idx] = val[ok] & 0xFFFF
                        out[idx + 1] = (val[ok] >> 16) & 0xFFFF
    bits = torch.where(out >= 2 ** 15, out - 2 ** 16, out).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(m, n)


class SimulatedKernel:
    """A compiled linear_sm90_wgmma entry's stand-in on the CPU (see the module docstring)."""

    def __init__(self, geom: WgGeometry, xop_dtype: torch.dtype = torch.bfloat16):
        self.geom = geom
        self.xop_dtype = xop_dtype          # float16 for a presum variant's operand
        self.calls: list[tuple[int, int, int, int]] = []

    @staticmethod
    def _view(ptr, nbytes: int, dtype, align: int) -> torch.Tensor:
        import ctypes

        addr = ptr._pointer
        if addr % align or ptr._assumed_align != align:
            raise AssertionError(f"pointer {addr:#x} promised {ptr._assumed_align}-byte "
                                 f"alignment, the kernel assumes {align}")
        buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(dtype)

    def __call__(self, wp, xp, yp, axp, awp, wsp, semp, m, rows, n, nk, *rest) -> None:
        from .linear_sm90_wgmma_geom import record_bytes

        g = self.geom
        streamk = bool(getattr(g, "streamk", 0))
        if len(rest) != 1 + streamk:
            raise AssertionError(f"{len(rest)} arguments after nk, the entry takes "
                                 f"{'(ctas, stream)' if streamk else '(stream)'}")
        m, rows, n, nk = (int(getattr(v, "value", v)) for v in (m, rows, n, nk))
        ctas = int(getattr(rest[0], "value", rest[0])) if streamk else None
        self.calls.append((m, rows, n, nk) + ((ctas,) if streamk else ()))
        if not g.split_ok(nk):
            raise AssertionError(f"launched with {nk} chunks for split_k={g.split_k}")
        kw_ws = {"ctas": ctas} if streamk else {}
        if streamk and not 1 <= ctas <= g.units(rows, n, nk):
            raise AssertionError(f"{ctas} stream-K CTAs for {g.units(rows, n, nk)} units")
        # the launcher's split-K buffers: big enough, semaphores at zero (and left at zero)
        self._view(wsp, 4 * max(g.ws_floats(rows, n, **kw_ws), 4), torch.float32, 16)
        sem = self._view(semp, 4 * max(g.sem_count(rows, n, **kw_ws), 1), torch.int32, 4)
        if bool((sem != 0).any()):
            raise AssertionError("a split-K semaphore is not zero at launch")
        rec = record_bytes(g.fmt)
        records = self._view(wp, n // 64 * nk * rec, torch.int32, 16).reshape(n // 64, nk,
                                                                               rec // 4)
        xop = self._view(xp, rows * nk * 128, self.xop_dtype, 16).reshape(rows, nk * 64)
        out = self._view(yp, m * n * 2, torch.bfloat16, 16).reshape(m, n)
        ax = self._view(axp, 4, torch.float32, 4).clone()
        aw = self._view(awp, 4, torch.float32, 4).clone()
        wt = WgWeight(g.fmt, g.packing, n, 0, nk * 64, records.clone(), aw)
        kw: dict = {"presum": True} if self.xop_dtype == torch.float16 else {}
        if streamk:
            kw["ctas"] = ctas
        out.copy_(simulate_launch(g, wt, xop.clone(), m, rows, ax if g.nv else None, **kw))


# ----------------------------------------------------------------------------- pipeline


@dataclass
class _Mbarrier:
    count: int
    phase: int = 0
    pending: int = 0
    tx: int = 0

    def __post_init__(self):
        self.pending = self.count

    def _maybe_flip(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, expect_tx: int = 0):
        if self.pending <= 0:
            raise AssertionError("arrival on a barrier with no pending arrivals")
        self.tx += expect_tx
        self.pending -= 1
        self._maybe_flip()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        if self.tx < 0:
            raise AssertionError("more bytes completed than expected")
        self._maybe_flip()

    def test(self, parity: int) -> bool:
        """mbarrier.try_wait.parity: true once the phase with this parity has completed."""
        return (self.phase % 2) != parity


@dataclass
class PipelineTrace:
    steps: int = 0
    reads: list = field(default_factory=list)       # (consumer, chunk, chunk found in stage)


def simulate_pipeline(geom: WgGeometry, nk: int, seed: int = 0,
                      max_steps: int = 1_000_000,
                      segments: list[int] | None = None) -> PipelineTrace:
    """Run the producer/consumer mbarrier protocol of the kernel for nk chunks in a random
    interleaving (a consumer warpgroup is one agent that arrives once per warp).

    The producer, per chunk c: wait empty[s] parity ph ^ 1; arrive.expect_tx(full[s], TX);
    the copies land later (asynchronously). A consumer, per chunk c: wait full[s] parity ph,
    read the stage, issue its MMAs, then (after wgmma.wait_group 1) release chunk c - 1's
    stage; the last chunk is never released. Each chunk's copies land as two parts (the weight
    records and the activation box), in any order, each completing its own bytes; a stage holds
    chunk c once both of c's parts have landed. PDL (geom.pdl): the producer first arrives on
    the first min(stages, nk) full barriers and issues only their weight parts, then (after
    griddepcontrol.wait, instantaneous here) their boxes, then continues as above.
    segments (stream-K): the CTA's nk chunks as consecutive segments of these lengths (one per
    tile it touches); a segment's first chunk releases nothing, and its last chunk's stage is
    released once it was read (wgmma.wait_group 0 ends a segment), the final one included.
    Raises AssertionError on a protocol violation or a deadlock."""
    starts: set[int] = set()
    ends: set[int] = set()
    if segments is not None:
        if sum(segments) != nk or min(segments) < 1:
            raise ValueError(f"segments {segments} do not cover {nk} chunks")
        c0 = 0
        for length in segments:
            starts.add(c0)
            ends.add(c0 + length - 1)
            c0 += length
    s_n = geom.stages
    full = [_Mbarrier(1) for _ in range(s_n)]
    empty = [_Mbarrier(geom.release_count) for _ in range(s_n)]
    content = [None] * s_n                 # chunk whose data a stage holds
    holders = [set() for _ in range(s_n)]  # consumers that may still read a stage
    in_flight: list[tuple[int, int, str]] = []   # (stage, chunk, part) issued, not landed
    landed = [dict() for _ in range(s_n)]        # stage -> {chunk: parts landed}
    nbytes = {"w": geom.w_stage_bytes, "b": geom.b_stage_bytes}
    rng = random.Random(seed)
    npre = min(s_n, nk) if geom.pdl else 0
    prod_c = 0
    boxes_due = npre > 0                   # PDL: the prologue's boxes, after the wait
    prod_waiting = True
    cons_c = [0] * geom.consumers
    trace = PipelineTrace()
    for step in range(max_steps):
        agents = []
        if prod_c < nk or boxes_due:
            agents.append("p")
        if in_flight:
            agents.append("tma")
        agents += [w for w in range(geom.consumers) if cons_c[w] < nk]
        if not agents:
            trace.steps = step
            return trace
        rng.shuffle(agents)
        progressed = False
        for a in agents:
            if a == "p" and prod_c == npre and boxes_due:
                for c in range(npre):                   # griddepcontrol.wait, then the boxes
                    in_flight.append((c, c, "b"))
                boxes_due = False
                progressed = True
                break
            if a == "p":
                if prod_c >= nk:
                    continue
                s, ph = geom.stage_of(prod_c)
                if prod_c < npre:                      # PDL prologue: first use, no wait
                    prod_waiting = False
                if prod_waiting:
                    if not empty[s].test(ph ^ 1):
                        continue
                    prod_waiting = False
                if holders[s]:
                    raise AssertionError(f"stage {s} refilled while consumers {holders[s]} "
                                         f"may still read chunk {content[s]}")
                full[s].arrive(expect_tx=geom.tx_bytes)
                in_flight.append((s, prod_c, "w"))
                if prod_c >= npre:
                    in_flight.append((s, prod_c, "b"))
                prod_c += 1
                prod_waiting = True
                progressed = True
                break
            if a == "tma":
                k = rng.randrange(len(in_flight))
                s, c, part = in_flight.pop(k)
                got = landed[s].setdefault(c, set())
                got.add(part)
                if got == {"w", "b"}:
                    content[s] = c
                    del landed[s][c]
                full[s].complete_tx(nbytes[part])
                progressed = True
                break
            w = a
            c = cons_c[w]
            s, ph = geom.stage_of(c)
            if not full[s].test(ph):
                continue
            trace.reads.append((w, c, content[s]))
            if content[s] != c:
                raise AssertionError(f"consumer {w} read chunk {content[s]} for chunk {c}")
            holders[s].add(w)
            if c > 0 and c not in starts:              # release chunk c - 1's stage
                sp, _ = geom.stage_of(c - 1)
                holders[sp].discard(w)
                for _ in range(4):                     # lane 0 of each of the 4 warps
                    empty[sp].arrive()
            if c in ends:                               # stream-K: the segment's last chunk
                holders[s].discard(w)
                for _ in range(4):
                    empty[s].arrive()
            cons_c[w] += 1
            progressed = True
            break
        if not progressed and not in_flight:
            raise AssertionError(f"deadlock: producer at chunk {prod_c}, consumers at {cons_c}")
    raise AssertionError("pipeline simulation did not finish")
