"""The quality study: one loaded model + calibration, evaluated under many FP4 methods.

A Method names everything that changes the numbers: format, compensation (plain "none", full
residue "full", a K-Ext ratio, a per-layer "plan" under an effective-bit budget, or "w4a16":
FP4 weights with BF16 activations, resgen.reference.linear_w4a16), the channel selection score,
the weight-side method and the activation tensor-scale mode. Study caches what methods share
(prepared weights, GPTQ bases, planner scores).

An FP4 checkpoint as the model (ModelOpt / compressed-tensors / resgen, read by
resgen.checkpoint): the reference is its dequantized weights in FP32; methods of the
checkpoint's own format with the plain weight method reuse its stored codes and scales
exactly; other formats, weight methods and K-Ext extensions quantize the dequantized weights.

Cost (CPU, FP32): memory is about 4 B per parameter for the model, 4 more while a method's
fake-quant layers exist, ~0.6 per prepared weight configuration kept (one per distinct format /
weight method / K-Ext ratio of the suite), plus the captured layer inputs (n_nmse * seq_len rows
of every input site, FP32) and, for GPTQ, a K x K float64 Hessian per site. Time is dominated by
the forward passes: calibration (n_calib windows) once, then n_eval windows per method (the paper
suite has 15 methods). docs/quality_report.md has measured figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import formats
from .. import weights as wmethods
from ..calibrate import QLinearWeight
from ..plan import PLAN_RATIOS, LayerCost, Plan, solve
from .capture import SiteStats, calibrate_sites, capture_grads, capture_inputs, site_of
from .evaluate import layer_nmse, perplexity
from .fakequant import COMPENSATIONS_EXTRA, FakeQuantLinear
from .model import BosChoice, TokenSplit, decide_bos, describe_model, load_model, load_tokens, \
    quantizable_linears, replace_linears, resolve_model, split_tokens
from .selection import select

__all__ = ["Method", "StudyConfig", "Study"]


@dataclass(frozen=True)
class Method:
    """One evaluated configuration (see the module docstring). comp: "ref" is the FP32 model,
    "w4a16" FP4 weights with BF16 activations (no activation quantization)."""

    fmt: str
    comp: str | float
    score: str = "mean_abs"
    weights: str = "amax"
    input_scale: str = "dynamic"
    budget: float | None = None
    fold: str = "exact"       # how the residue's product joins the base's (reference.FOLDS)

    def __post_init__(self):
        if self.comp != "ref":
            formats.block_size(self.fmt)
        if (self.comp not in ("ref", "none", "full", "plan", *COMPENSATIONS_EXTRA)
                and self.comp not in PLAN_RATIOS[1:-1]):
            raise ValueError(f"comp must be ref/none/full/plan/w4a16/w4a8 or a K-Ext ratio, got "
                             f"{self.comp!r}")
        if self.comp in COMPENSATIONS_EXTRA and self.input_scale != "dynamic":
            raise ValueError(f"{self.comp.upper()} does not quantize activations to FP4: no "
                             f"activation scale mode")
        if (self.comp == "plan") != (self.budget is not None):
            raise ValueError("a budget is given exactly when comp == 'plan'")
        if self.input_scale not in ("dynamic", "static"):
            raise ValueError("input_scale must be 'dynamic' or 'static'")
        if self.input_scale == "static" and self.fmt != "nvfp4":
            raise ValueError("a static input_scale exists for NVFP4 only")
        if self.weights not in wmethods.WEIGHT_METHODS:
            raise ValueError(f"unknown weight method {self.weights!r}")
        from ..reference import FOLDS
        if self.fold not in FOLDS:
            raise ValueError(f"fold must be one of {FOLDS}, got {self.fold!r}")
        if self.fold != "exact" and self.comp in ("ref", "none", "plan", *COMPENSATIONS_EXTRA):
            raise ValueError(f"fold={self.fold!r} needs a residue: comp 'full' or a K-Ext ratio, "
                             f"got {self.comp!r}")

    def label(self) -> str:
        if self.comp == "ref":
            return "FP32 reference"
        comp = {"none": "W4A4", "full": "full residue", "w4a16": "W4A16",
                "w4a8": "W4A8 (FP8 E4M3 per-token activations)"}.get(self.comp)
        if comp is None:
            comp = f"plan {self.budget} bits" if self.comp == "plan" else f"ratio {self.comp}"
        parts = [self.fmt.upper(), comp]
        if self.comp not in ("none", "full", *COMPENSATIONS_EXTRA):
            parts.append(f"sel={self.score}")
        if self.weights != "amax":
            parts.append(f"w={self.weights}")
        if self.input_scale == "static":
            parts.append("static act scale")
        if self.fold != "exact":
            parts.append(f"fold={self.fold}")
        return " ".join(parts)

    def to_json(self) -> dict:
        """The method's record; "fold" only where it is not the exact fold, so records
        written before the fold existed still match (resume, subset)."""
        out = {"fmt": self.fmt, "comp": self.comp, "score": self.score, "weights": self.weights,
               "input_scale": self.input_scale, "budget": self.budget, "label": self.label()}
        if self.fold != "exact":
            out["fold"] = self.fold
        return out


@dataclass(frozen=True)
class StudyConfig:
    """Token budgets of a run (documented in the JSON). quick() is the smoke-test size."""

    seq_len: int = 512
    n_calib: int = 16         # calibration sequences (selection, importance, GPTQ, scales)
    n_eval: int = 8           # held-out perplexity sequences (paired across methods)
    n_nmse: int = 1           # held-out sequences whose layer inputs give per-layer NMSE
    n_grad: int = 2           # calibration sequences for the planner's gradient scores
    batch: int = 4
    text: str | None = None   # None: Debian's jargon.txt.gz
    model_dir: str | None = None   # what resolve_model takes; None: SmolLM2-135M
    bos: str = "auto"         # windows start with BOS: auto (as the tokenizer does) / yes / no

    @staticmethod
    def quick() -> "StudyConfig":
        return StudyConfig(seq_len=128, n_calib=4, n_eval=4, n_nmse=1, n_grad=1, batch=4)


@dataclass
class Study:
    config: StudyConfig
    need_hessian: bool = False
    log: callable = print
    model: object = None      # a preloaded causal LM (tests); None loads config.model_dir
    tokens: torch.Tensor | None = None   # int64 [T] token stream; None tokenizes config.text
    split: TokenSplit = field(init=False)
    stats: dict[str, SiteStats] = field(init=False)
    nmse_inputs: dict[str, torch.Tensor] = field(init=False)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        t0 = time.time()
        cfg = self.config
        tok = None
        self.source = None
        if self.model is None:
            self.source = resolve_model(cfg.model_dir)
            self.model, tok = load_model(self.source)
        if self.tokens is None:
            if tok is None:
                raise ValueError("a preloaded model needs its token stream (tokens=...)")
            self.tokens = load_tokens(tok) if cfg.text is None else load_tokens(tok, cfg.text)
        self.bos: BosChoice = decide_bos(tok, self.model.config, cfg.bos,
                                         getattr(self.model, "generation_config", None))
        if not self.bos.certain:
            self.log(f"WARNING: {self.bos.reason}")
        self.model_info = (describe_model(self.model, self.source) if self.source is not None
                           else None)
        ids = self.tokens
        self.split = split_tokens(ids, seq_len=cfg.seq_len, n_calib=cfg.n_calib,
                                  n_eval=cfg.n_eval, bos=self.bos.token_id)
        self.total_tokens = int(ids.numel())
        self.linears = quantizable_linears(self.model)
        self.weight = {n: m.weight.detach().float().clone() for n, m in self.linears.items()}
        self.bias = {n: m.bias.detach().float().clone() for n, m in self.linears.items()
                     if m.bias is not None}
        self.timings["load_s"] = time.time() - t0
        t0 = time.time()
        self.stats = calibrate_sites(self.model, self.split.calib, batch=cfg.batch,
                                     hessian=self.need_hessian)
        self.timings["calibrate_s"] = time.time() - t0
        self.nmse_inputs = capture_inputs(self.model, self.split.eval[: cfg.n_nmse],
                                          batch=cfg.batch)
        self._qw: dict[tuple, QLinearWeight] = {}
        self._base: dict[tuple, formats.QuantizedTensor] = {}
        self._scores: dict[tuple, dict[str, dict[float, float]]] = {}
        self._grad_data = None
        self._ppl_ref: dict | None = None

    # ----------------------------------------------------------------- layers

    def shapes(self) -> dict[str, LayerCost]:
        return {n: LayerCost(*w.shape) for n, w in self.weight.items()}

    def qweight(self, name: str, m: Method, ratio) -> QLinearWeight:
        """Prepared weight of layer `name` for method m at compensation `ratio`."""
        kext = ratio not in ("none", "full", 0.0, 1.0, *COMPENSATIONS_EXTRA)
        key = (name, m.fmt, m.weights, m.input_scale, ratio if kext else None,
               m.score if kext else None)
        if key in self._qw:
            return self._qw[key]
        w = self.weight[name]
        st = self.stats[site_of(name)]
        sel = select(m.score, st, w, m.fmt, ratio) if kext else None
        isc = st.input_scale() if m.input_scale == "static" else None
        ck = getattr(self.model, "_resgen_checkpoint", None)
        if (ck is not None and ck["fmt"] == m.fmt and m.weights == "amax" and not kext
                and name in ck["linears"]):
            # an FP4 checkpoint's own codes and scales (requantizing its dequantized weight
            # would not reproduce them); the activation scale is the method's
            src = ck["linears"][name]
            qw = QLinearWeight(src.base(), src.in_features, None, isc, src.meta)
            self._qw[key] = qw
            return qw
        base = None
        if m.weights == "gptq":
            bkey = (name, m.fmt)
            if bkey not in self._base:
                self._base[bkey] = wmethods.gptq(w, st.hessian, m.fmt)
            base = self._base[bkey]
        ext_imp = None if sel is None else st.mean_res_sq(m.fmt)[sel.indices]
        qw = wmethods.prepare(w, m.fmt, m.weights, selection=sel,
                              importance=st.channel.mean_sq(), ext_importance=ext_imp,
                              hessian=st.hessian, input_scale=isc, base=base)
        self._qw[key] = qw
        return qw

    def module(self, name: str, m: Method, ratio) -> FakeQuantLinear:
        comp = {0.0: "none", 1.0: "full"}.get(ratio, ratio)
        return FakeQuantLinear(self.qweight(name, m, comp), comp, self.bias.get(name),
                               fold=m.fold if comp not in ("none", *COMPENSATIONS_EXTRA)
                               else "exact")

    def ratios(self, m: Method) -> dict[str, float | str]:
        """Layer -> compensation for method m (solving the plan when m.comp == 'plan')."""
        if m.comp == "plan":
            return dict(self.plan(m).ratios)
        return {n: m.comp for n in self.weight}

    # ----------------------------------------------------------------- planner

    def _grads(self):
        if self._grad_data is None:
            seqs = self.split.calib[: self.config.n_grad]
            t0 = time.time()
            x = capture_inputs(self.model, seqs, batch=self.config.batch)
            g = capture_grads(self.model, seqs, batch=max(1, self.config.batch // 2))
            self._grad_data = (x, g)
            self.timings["grads_s"] = time.time() - t0
        return self._grad_data

    @torch.no_grad()
    def plan_scores(self, m: Method) -> dict[str, dict[float, float]]:
        """Gradient-weighted output error of every layer at every plan ratio (BRECQ-style):
        score(l, r) = sum over calibration tokens and outputs of (dL/dy * (y_r - y))^2."""
        key = (m.fmt, m.score, m.weights, m.input_scale)
        if key not in self._scores:
            x_all, g_all = self._grads()
            out: dict[str, dict[float, float]] = {}
            for name, w in self.weight.items():
                x = x_all[site_of(name)]
                g2 = g_all[name].double() ** 2
                ref = x.double() @ w.double().T
                if name in self.bias:
                    ref = ref + self.bias[name].double()
                out[name] = {r: float((g2 * (self.module(name, m, r)(x).double() - ref) ** 2)
                                      .sum()) for r in PLAN_RATIOS}
            self._scores[key] = out
        return self._scores[key]

    def plan(self, m: Method) -> Plan:
        return solve(self.plan_scores(m), self.shapes(), m.budget, fmt=m.fmt)

    # ----------------------------------------------------------------- evaluation

    def evaluate(self, m: Method) -> dict:
        """Perplexity on the held-out split + per-layer output NMSE for method m."""
        t0 = time.time()
        res: dict = {"method": m.to_json()}
        if m.comp == "ref":
            if self._ppl_ref is None:
                self._ppl_ref = perplexity(self.model, self.split.eval, batch=self.config.batch)
            res.update(self._ppl_ref)
            res["seconds"] = time.time() - t0
            return res
        ratios = self.ratios(m)
        mods = {n: self.module(n, m, r) for n, r in ratios.items()}
        res["layer_nmse"] = {n: layer_nmse(mod, self.nmse_inputs[site_of(n)], self.weight[n],
                                           self.bias.get(n))
                             for n, mod in mods.items()}
        old = replace_linears(self.model, mods)
        try:
            res.update(perplexity(self.model, self.split.eval, batch=self.config.batch))
        finally:
            replace_linears(self.model, old)
        if m.comp in COMPENSATIONS_EXTRA:
            # activation operand bits, as the plan counts them: BF16 never quantized, or FP8
            res["effective_bits"] = 16.0 if m.comp == "w4a16" else 8.0
            res["seconds"] = time.time() - t0
            return res
        plan_r = {n: {"none": 0.0, "full": 1.0}.get(r, r) for n, r in ratios.items()}
        from ..plan import effective_bits
        res["effective_bits"] = effective_bits(self.shapes(), plan_r, m.fmt)
        if m.comp == "plan":
            res["plan"] = plan_r
        res["seconds"] = time.time() - t0
        return res
