"""The decoder forward: prefill over a ragged batch of prompts and one decode step, on any
backend's ops (resgen.engine.backend) and either KV cache (resgen.engine.kv).

Per layer (Llama / Qwen2 / Qwen3; x: [T, hidden] in the glue dtype):

    a = rmsnorm(h) * w_in;  q, k, v = split(QKV(a) [+ bias])       q/k/v fused: one GEMM
    Qwen3: q, k = rmsnorm_head(q) * w_q, rmsnorm_head(k) * w_k     per head, before RoPE
    q, k = rope(q, k at their positions)
    store k, v in the layer's KV cache (NVFP4 append kernel, or dense)
    h = h + O(attention(q))
    a = rmsnorm(h) * w_post;  g, u = split(GATE_UP(a));  h = h + DOWN(silu(g) * u)

then logits = LM_head(rmsnorm(h) * w_final) in the head dtype (BF16 with BF16 glue: the LM head
is NOT quantized; cuBLAS on the GPU), returned in FP32.

Glue dtype: "bf16" (the serving setting: F.rms_norm fused, SwiGLU and residual adds in BF16,
as bench/decode_step.py measured) or "fp32" (residual stream, norms, RoPE and prefill
attention in FP32, norms written as transformers' FP32 RMSNorm: the correctness setting; only
the kernels' own BF16 interface rounds). The FP4 linears always see BF16 (their contract) on
the kernel backends.

Prefill attention is exact on the prompt: every prompt attends to its own unquantized q / k /
v (causal SDPA in the glue dtype, FlashAttention on the H200 for BF16), one call for prompts
of one length and one per prompt otherwise; the quantized K/V go to the cache only for the
decode steps that follow. That is both the fastest exact path available in torch and the
numerics of the CPU quality study, whose fake-quant model quantizes the linears only.

Decode attention: the NVFP4 engine runs resgen.ops.DecodeAttention (ResAttn or plain) over the
paged cache; the BF16 engine attends over its dense cache with each row's length
(DenseDecodeAttention: torch's varlen FlashAttention with seqused_k where this torch has it,
masked SDPA otherwise; rows of length 0 give zeros).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .config import DecoderConfig
from .glue import REGIONS, EagerGlue, finish, rms_norm, to_io
from .rope import rope_pairs, rope_tables

__all__ = ["rms_norm", "Proj", "DenseLinear", "LayerOps", "DecoderModel", "DecodeState",
           "DenseDecodeAttention", "prefill_attention", "rows_bucket", "GLUE"]

GLUE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rows_bucket(t: int) -> int:
    """Row count a prefill of t tokens runs at (zero rows pad it): powers of two up to 64, then
    multiples of 64, so prompt lengths share kernel plans (each plan keeps its buffers)."""
    if t <= 64:
        return 1 << max(0, t - 1).bit_length()
    return -(-t // 64) * 64


class DenseLinear:
    """y = x W^T with W in its own dtype (BF16: cuBLAS; the BF16 engine and calibration).
    `weight` is what runs; `source` what FP4 quantization reads (the checkpoint's values)."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.source = w
        self.weight = w.to(dtype).contiguous()
        self.n, self.k = w.shape

    def warmup(self, ms: Any) -> list:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class Proj:
    """One fused projection: the backend op between the glue and the op's I/O dtype, plus the
    optional bias (added in FP32, one rounding to the glue dtype, as FP4Linear does). Bias
    float32 [N] on the op's device."""

    def __init__(self, op: Any, io_dtype: torch.dtype, glue: torch.dtype,
                 bias: torch.Tensor | None = None, qweight: Any = None,
                 compensation: str | None = None) -> None:
        self.op, self.io_dtype, self.glue = op, io_dtype, glue
        self.bias = None if bias is None else bias.detach().float()
        # the FP4 weight and compensation this projection runs (None: a dense projection)
        self.qweight, self.compensation = qweight, compensation

    def warmup(self, ms: Any) -> Any:
        return self.op.warmup(ms)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The op alone: x (any dtype) cast to the op's I/O dtype -> its raw output (the
        glue applies `finish`, resgen.engine.glue)."""
        return self.op(to_io(x, self.io_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return finish(self.run(x), self.bias, self.glue)


@dataclass
class LayerOps:
    """One decoder layer: its four projections and norm weights (glue dtype)."""

    qkv: Proj
    o: Proj
    gate_up: Proj
    down: Proj
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    def projections(self) -> dict[str, Proj]:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                      scale: float) -> torch.Tensor:
    """Causal attention of each prompt over itself. q: [T, Hq, D], k, v: [T, Hkv, D] with the
    prompts back to back (lengths `lens`, sum T) -> [T, Hq, D] (q's dtype)."""
    gqa = q.shape[1] != k.shape[1]
    if len(set(lens)) == 1:
        b, n = len(lens), lens[0]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(b, n, x.shape[1], x.shape[2]).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True,
                                           scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(q.shape)
    outs, s = [], 0
    for n in lens:
        outs.append(prefill_attention(q[s:s + n], k[s:s + n], v[s:s + n], [n], scale))
        s += n
    return torch.cat(outs)


class DenseDecodeAttention:
    """Decode attention over a dense cache: q [B, Hq, D], k / v [B, L, Hkv, D] (rows' first
    seq_lens[b] positions valid) -> [B, Hq, D]; seq_lens 0 gives zeros. No host syncs.

    mode "varlen": torch.nn.attention.varlen.varlen_attn with seqused_k (FlashAttention, one
    launch, split over KV), where this torch has it and it agrees with "masked" on a probe;
    "flash": the same FlashAttention kernel through aten::_flash_attention_forward's
    seqused_k, for a torch whose public varlen_attn lacks seqused_k / enable_gqa (the H200's
    torch 2.11 fell back to "masked" without it), probed the same way;
    "masked": SDPA with the GQA group as query rows and a key mask (no FlashAttention)."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode

    def resolve(self, device: torch.device, dtype: torch.dtype, kv_heads: int, group: int,
                head_dim: int) -> str:
        """Pick the mode now (before any CUDA graph capture)."""
        if self.mode == "auto":
            self.mode = "masked"
            if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
                self.mode = _probe_varlen(device, dtype, kv_heads, group, head_dim)
        return self.mode

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None
                 ) -> torch.Tensor:
        """k, v: the rows' whole cache [B, max_len, Hkv, D]; window: the KV class (>= every
        row's length), the positions read."""
        if self.mode == "varlen":
            return _varlen_decode(q, k, v, seq_lens, scale, window)
        if self.mode == "flash":
            return _flash_decode(q, k, v, seq_lens, scale, window)
        return _masked_decode(q, k, v, seq_lens, scale, window)


def _masked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float, window: int | None = None) -> torch.Tensor:
    if window is not None:
        k, v = k[:, :window], v[:, :window]
    b, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    pos = torch.arange(n, device=q.device)
    lens = seq_lens.to(torch.int64)[:, None]
    # an empty row attends to its slot 0 (finite), and is zeroed after
    mask = (pos[None, :] < lens) | ((lens == 0) & (pos[None, :] == 0))
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=scale)
    o = o.reshape(b, hq, d)
    return o * (seq_lens > 0).to(o.dtype)[:, None, None]


def _rows_as_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The dense cache as a varlen batch: k, v [B * max_len, Hkv, D] (rows stay whole: a
    [B, max_len] view is contiguous, a window of it is not), cu_q int32 [B + 1] (one query
    per row), cu_k = cu_q * max_len (row b's keys start at b * max_len; seqused_k says how
    many are used), max_len."""
    b, n = k.shape[0], k.shape[1]
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    return (k.reshape(b * n, k.shape[2], k.shape[3]), v.reshape(b * n, v.shape[2], v.shape[3]),
            cu_q, cu_q * n, n)


def _varlen_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float, window: int | None = None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    kf, vf, cu_q, cu_k, n = _rows_as_varlen(q, k, v)
    o = varlen_attn(q, kf, vf, cu_q, cu_k, 1, window or n, scale=scale,
                    enable_gqa=q.shape[1] != k.shape[2], seqused_k=seq_lens)
    return o * (seq_lens > 0).to(o.dtype)[:, None, None]


def _flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, window: int | None = None) -> torch.Tensor:
    # the same kernel through the aten op torch's varlen_attn wraps
    kf, vf, cu_q, cu_k, n = _rows_as_varlen(q, k, v)
    o = torch.ops.aten._flash_attention_forward(q, kf, vf, cu_q, cu_k, 1, window or n, 0.0,
                                                False, False, scale=scale,
                                                seqused_k=seq_lens)[0]
    return o * (seq_lens > 0).to(o.dtype)[:, None, None]


def _probe_varlen(device: torch.device, dtype: torch.dtype, kv_heads: int, group: int,
                  head_dim: int) -> str:
    """The first FlashAttention path that agrees with "masked" on a probe of ragged rows
    (one empty) on this device, else "masked"."""
    g = torch.Generator(device=device).manual_seed(0)
    b, n = 3, 96
    q = torch.randn(b, kv_heads * group, head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(b, n, kv_heads, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(b, n, kv_heads, head_dim, generator=g, device=device).to(dtype)
    lens = torch.tensor([60, 17, 0], dtype=torch.int32, device=device)
    ref = _masked_decode(q, k, v, lens, head_dim ** -0.5, 64).float()

    def agrees(fn: Callable[..., torch.Tensor]) -> bool:
        try:
            got = fn(q, k, v, lens, head_dim ** -0.5, 64).float()
        except Exception:            # no such kernel in this torch / for this GPU
            return False
        return bool(torch.isfinite(got).all()) and float((got - ref).norm()) <= \
            2e-2 * float(ref.norm())

    try:
        from torch.nn.attention.varlen import varlen_attn
        names = inspect.signature(varlen_attn).parameters
        if "seqused_k" in names and "enable_gqa" in names and agrees(_varlen_decode):
            return "varlen"
    except ImportError:
        pass
    if agrees(_flash_decode):
        return "flash"
    return "masked"


@dataclass
class DecodeState:
    """Static decode buffers for up to `rows` sequences (CUDA-graph inputs and outputs).

    tokens int64 [R] (the token each row feeds; padded rows the zero-embedding pad id),
    pos int64 [R] (its position), seq_lens int32 [R] (pos + 1; 0 for padded rows),
    app_pos int32 [R, 2] (row, pos: the append kernel's positions), block_tables int32 [R, P],
    active int32 [R] (1 for real rows), logits float32 [R, V]. A step advances pos, seq_lens
    and app_pos of the active rows itself, so a replay needs no host writes."""

    tokens: torch.Tensor
    pos: torch.Tensor
    seq_lens: torch.Tensor
    app_pos: torch.Tensor
    block_tables: torch.Tensor
    active: torch.Tensor
    logits: torch.Tensor
    rows_ids: torch.Tensor

    @classmethod
    def create(cls, rows: int, max_pages: int, vocab: int, device: torch.device
               ) -> "DecodeState":
        z = dict(device=device)
        app = torch.zeros(rows, 2, dtype=torch.int32, **z)
        app[:, 0] = torch.arange(rows, dtype=torch.int32, **z)
        return cls(torch.zeros(rows, dtype=torch.int64, **z),
                   torch.zeros(rows, dtype=torch.int64, **z),
                   torch.zeros(rows, dtype=torch.int32, **z), app,
                   torch.zeros(rows, max(1, max_pages), dtype=torch.int32, **z),
                   torch.zeros(rows, dtype=torch.int32, **z),
                   torch.zeros(rows, vocab, dtype=torch.float32, **z),
                   torch.arange(rows, dtype=torch.int64, **z))

    def advance(self, b: int) -> None:
        act = self.active[:b]
        self.pos[:b].add_(act)          # in place on the views (no write-back copy_ call)
        self.seq_lens[:b].add_(act)
        self.app_pos[:b, 1].copy_(self.pos[:b])


class DecoderModel:
    """A decoder on one backend (see the module docstring). Built by resgen.engine.build;
    `kv` (PagedKV or DenseKV), `attn` (the paged attention op, or DenseDecodeAttention) and
    `append` (the paged append op) are attached by the engine."""

    def __init__(self, cfg: DecoderConfig, layers: list[LayerOps], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, glue: str,
                 device: torch.device, backend_io: torch.dtype) -> None:
        self.cfg, self.layers, self.glue_name = cfg, layers, glue
        self.glue = GLUE[glue]
        self.device = device
        self.io_dtype = backend_io
        v, h = embed.shape
        if v != cfg.vocab_size or h != cfg.hidden:
            raise ValueError(f"embedding is {tuple(embed.shape)}, the config says "
                             f"[{cfg.vocab_size}, {cfg.hidden}]")
        # one extra zero row: the pad id of padded batch rows (they then stay zero)
        self.embed = torch.cat([embed.to(device, self.glue),
                                torch.zeros(1, h, dtype=self.glue, device=device)])
        self.pad_id = v
        self.final_norm = final_norm.to(device, self.glue)
        self.lm_head = lm_head.to(device, self.glue).contiguous()
        self.scale = cfg.head_dim ** -0.5
        cos, sin = rope_tables(cfg.rope, cfg.head_dim, cfg.max_positions, device)
        # [P, 2, D]: cos and the rolled signed sin (resgen.engine.rope.apply_rope)
        self.rope_cs = rope_pairs(cos, sin).to(self.glue)
        # prefill row padding (rows_bucket) for the kernels' plan reuse; the reference backend
        # runs the exact row count (FP32 GEMMs round differently with more rows)
        self.pad_rows = backend_io == torch.bfloat16
        self.kv: Any = None
        self.attn_io = backend_io       # q / k / v dtype of the paged append and attention
        self.attn: Any = None
        self.attn_plans: dict[tuple[int, int], Any] = {}   # (rows, KV class) -> bound kernel
        self.append: Callable[..., None] | None = None
        # the glue between the ops: eager, or torch.compile'd (resgen.engine.glue)
        self.glue_fns: Any = EagerGlue()

    # ------------------------------------------------------------------ one layer
    def _layer(self, i: int, h: torch.Tensor, a: torch.Tensor | None, cs: torch.Tensor,
               store: Callable[[torch.Tensor, torch.Tensor], None] | None,
               attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
               fns: dict[str, Callable[..., Any]],
               record: Callable[[str, torch.Tensor], None] | None = None,
               qkv_dtype: torch.dtype | None = None, w_next: torch.Tensor | None = None,
               next_io: torch.dtype | None = None, mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i on h [T, hidden] (a: its QKV input when the previous layer's last region
        computed it, else None) through the glue regions `fns` (resgen.engine.glue) and the
        ops -> (h, the next QKV input: normed with w_next, cast to next_io; None without
        w_next). qkv_dtype: q / k / v cast and made contiguous for the paged decode kernels;
        mask [T, 1]: rows kept (decode under an O bias). With `record` (calibration) every
        site is recorded in the glue dtype, before its projection's cast."""
        c, L = self.cfg, self.layers[i]
        t = h.shape[0]

        def io(p: Proj) -> torch.dtype | None:
            return None if record is not None else p.io_dtype
        if a is None:
            a = fns["attn_in"](h, L.in_norm, eps=c.rms_eps, io=io(L.qkv))
        if record is not None:
            record("attn_in", a)
        q, k, v = fns["qkv"](L.qkv.run(a), L.qkv.bias, L.q_norm, L.k_norm, cs,
                             heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                             eps=c.rms_eps, glue=self.glue, out_dtype=qkv_dtype)
        if store is not None:
            store(k, v)
        o = attend(q, k, v).reshape(t, c.q_size)
        if record is not None:
            record("o_in", o)
        h, a = fns["attn_out"](h, L.o.run(o), L.o.bias, L.post_norm, eps=c.rms_eps,
                               glue=self.glue, io=io(L.gate_up))
        if record is not None:
            record("mlp_in", a)
        m = fns["mlp_mid"](L.gate_up.run(a), intermediate=c.intermediate, glue=self.glue,
                           io=io(L.down))
        if record is not None:
            record("down_in", m)
        return fns["mlp_out"](h, L.down.run(m), w_next, mask, eps=c.rms_eps, glue=self.glue,
                              io=None if record is not None else next_io)

    def _o_dtype(self, o: torch.Tensor) -> torch.Tensor:
        """An attention output in its op's dtype, as the O projection may take it: the glue
        rounding is skipped where it is exact (FP32 glue holds every BF16 value; the
        projection casts to its own dtype)."""
        return o if o.dtype == self.glue or self.glue == torch.float32 else o.to(self.glue)

    def head(self, a: torch.Tensor) -> torch.Tensor:
        """a: the final-normed hidden states [T, hidden] -> logits [T, V] in the head dtype."""
        return F.linear(to_io(a, self.lm_head.dtype), self.lm_head)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: final hidden states [T, hidden] (before the final norm) -> float32 [T, V]."""
        return self.head(rms_norm(h, self.final_norm, self.cfg.rms_eps)).float()

    # ------------------------------------------------------------------ prefill
    def prefill(self, seqs: list[torch.Tensor], rows: list[int] | None = None,
                block_tables: torch.Tensor | None = None, *, store: bool = True,
                want: str = "last", record: Callable[[int], Any] | None = None
                ) -> torch.Tensor:
        """Run prompts (int64 [n_i] each) through the model from position 0.

        rows: each prompt's batch row (its dense KV row / block-table row); block_tables:
        int32 [rows, P] on the device (paged cache). store=False skips the KV cache
        (calibration, perplexity). want "last": float32 [len(seqs), V] logits of each
        prompt's last token; "hidden": the final hidden states [T, hidden] of all tokens
        (model.logits turns them into logits); "none": None. record(layer) -> (site, x)
        callback: the inputs of that layer's projections (calibration)."""
        lens = [int(s.numel()) for s in seqs]
        if not lens or min(lens) < 1:
            raise ValueError("every prompt needs at least one token")
        if max(lens) > self.cfg.max_positions:
            raise ValueError(f"a prompt of {max(lens)} tokens exceeds the model's "
                             f"{self.cfg.max_positions} positions")
        t = sum(lens)
        tp = rows_bucket(t) if self.pad_rows else t
        dev = self.device
        flat = torch.cat([s.reshape(-1).to("cpu", torch.int64) for s in seqs])
        if bool(((flat < 0) | (flat >= self.cfg.vocab_size)).any()):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        ids = torch.full((tp,), self.pad_id, dtype=torch.int64)
        ids[:t] = flat
        pos = torch.zeros(tp, dtype=torch.int64)
        pos[:t] = torch.cat([torch.arange(n) for n in lens])
        ids, pos = ids.to(dev), pos.to(dev)
        h = self.embed[ids]
        cs = self.rope_cs[pos]
        # calibration records every site: eager regions (the records are eager values)
        fns = self.glue_fns.regions("prefill", tp) if record is None else REGIONS
        row_of = torch.cat([torch.full((n,), r, dtype=torch.int64) for n, r in
                            zip(lens, rows if rows is not None else range(len(lens)))]).to(dev)
        app = torch.stack([row_of, pos[:t]], 1).to(torch.int32)
        a = None
        for i in range(len(self.layers)):
            st = None
            if store:
                st = self._prefill_store(i, app, block_tables, t)
            rec = None
            if record is not None:
                r_i = record(i)
                rec = (lambda site, x, _r=r_i: _r(site, x[:t]))

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                o = prefill_attention(q[:t], k[:t], v[:t], lens, self.scale)
                if tp > t:
                    o = torch.cat([o, o.new_zeros(tp - t, *o.shape[1:])])
                return o
            # the next layer's input norm joins this layer's last region unless rows must
            # be zeroed in between
            zero = self.cfg.o_bias and tp > t
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) and not zero else None
            h, a = self._layer(i, h, a, cs, st, attend, fns, rec,
                               w_next=None if nxt is None else nxt.in_norm,
                               next_io=None if nxt is None else nxt.qkv.io_dtype)
            if zero:
                h[t:] = 0           # padded rows stay zero (an o bias would move them)
        if want == "none":
            return None
        if want == "hidden":
            return h[:t]
        last = torch.tensor([sum(lens[: j + 1]) - 1 for j in range(len(lens))], device=dev)
        return self.logits(h[last])

    def _prefill_store(self, i: int, app: torch.Tensor, block_tables: torch.Tensor | None,
                       t: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        kv = self.kv

        def store(k: torch.Tensor, v: torch.Tensor) -> None:
            k, v = k[:t], v[:t]
            if kv.kind == "nvfp4":
                self.append(kv.caches[i], k.to(self.attn_io).contiguous(),
                            v.to(self.attn_io).contiguous(), block_tables, app)
            else:
                r, p = app[:, 0].long(), app[:, 1].long()
                kv.k[i][r, p] = k.to(kv.k[i].dtype)
                kv.v[i][r, p] = v.to(kv.v[i].dtype)
        return store

    # ------------------------------------------------------------------ decode
    def decode(self, st: DecodeState, b: int, kv_len: int) -> None:
        """One decode step of rows [0, b) (CUDA-graph capturable: no host syncs, no
        allocations outside the graph pool): the tokens in st.tokens at st.pos -> logits in
        st.logits; then st.advance(b). kv_len: the KV-length class (>= every row's length
        after this token): the attention plan, the dense cache's window."""
        tok, pos = st.tokens[:b], st.pos[:b]
        h = self.embed[tok]
        cs = self.rope_cs[pos]
        kv = self.kv
        lens = st.seq_lens[:b]
        c = self.cfg
        fns = self.glue_fns.regions("decode", b)
        # padded rows kept at zero under an O bias: the mask once per step
        mask = st.active[:b, None].to(self.glue) if c.o_bias else None
        # the paged kernels take contiguous q / k / v in their dtype: cast in the qkv region
        qkv_dtype = self.attn_io if kv.kind == "nvfp4" else None
        a = None
        n = len(self.layers)
        for i in range(n):
            if kv.kind == "nvfp4":
                cache, bt, app = kv.caches[i], st.block_tables[:b], st.app_pos[:b]

                def store(k: torch.Tensor, v: torch.Tensor, _c=cache, _bt=bt, _a=app) -> None:
                    self.append(_c, k.to(self.attn_io).contiguous(),
                                v.to(self.attn_io).contiguous(), _bt, _a)

                def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _c=cache,
                           _bt=bt) -> torch.Tensor:
                    qq = q.to(self.attn_io).contiguous()
                    op = self.attn_plans.get((b, kv_len))
                    o = op(qq, _c, _bt, lens) if op is not None else \
                        self.attn(qq, _c, _bt, lens, max_kv_len=kv_len)
                    return self._o_dtype(o)
            else:
                kc, vc = kv.k[i], kv.v[i]
                rid = st.rows_ids[:b]

                def store(k: torch.Tensor, v: torch.Tensor, _k=kc, _v=vc, _r=rid) -> None:
                    _k[_r, pos] = k.to(_k.dtype)
                    _v[_r, pos] = v.to(_v.dtype)

                def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _k=kc,
                           _v=vc) -> torch.Tensor:
                    o = self.attn(q.to(_k.dtype), _k[:b], _v[:b], lens, self.scale, kv_len)
                    return self._o_dtype(o)
            # the last region adds the residual and norms for the next layer (the final
            # norm after the last one)
            last = i + 1 == n
            w_next = self.final_norm if last else self.layers[i + 1].in_norm
            h, a = self._layer(i, h, a, cs, store, attend, fns, qkv_dtype=qkv_dtype,
                               w_next=w_next, mask=mask,
                               next_io=self.lm_head.dtype if last else
                               self.layers[i + 1].qkv.io_dtype)
        # the head's output converted to FP32 by the copy itself (no separate cast)
        st.logits[:b].copy_(self.head(a))
        st.advance(b)

    def warmup(self, b: int, kv_len: int, max_len: int | None = None) -> None:
        """Build every plan a decode step of b rows at KV class kv_len uses (compiles,
        buffers), so the step can be captured; max_len: the longest row now.

        The attention plan is built for max_len and kept for the class: rows only grow, and a
        variant valid for max_len stays valid for every longer length (more pages for its
        splits), while DecodeAttention caches a plan for the whole class only when it is valid
        down to the class floor (plans that are not would be rebuilt inside a capture)."""
        for L in self.layers:
            for p in L.projections().values():
                p.warmup([b])
        if self.kv.kind == "nvfp4":
            plan = getattr(self.attn, "plan", None)
            if plan is not None:
                self.attn_plans[(b, kv_len)] = plan(b, max_len or kv_len).op
            else:
                self.attn.warmup([(b, kv_len)])
