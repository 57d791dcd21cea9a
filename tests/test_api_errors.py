"""The Python API refuses bad input with a clear ValueError / TypeError or gives a defined
result (issue 22 items 6, 9, 17): formats, the reference operators, checkpoints, selections,
the KV cache, model specs and compressed tables."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fakefam import isolated_cache  # noqa: F401
from resgen import formats as F
from resgen import reference as R
from resgen.calibrate import (Selection, load_layers, prepare_weight, save_layers,
                              select_channels)
from resgen.kvcache import PagedKVCache
from resgen.models import ModelSpec


# -- item 9: formats ------------------------------------------------------------------------------
def test_quantized_tensors_refuse_wrong_scales():
    q = F.quantize(torch.randn(4, 64), "nvfp4")
    with pytest.raises(ValueError, match="need scales of shape"):
        F.QuantizedTensor("nvfp4", q.codes, q.scales[:, :1], q.global_scale)   # broadcast
    with pytest.raises(ValueError, match="need scales of shape"):
        F.QuantizedTensor("nvfp4", q.codes, q.scales[:3], q.global_scale)
    with pytest.raises(ValueError, match="scales must be"):
        F.QuantizedTensor("nvfp4", q.codes, q.scales.view(torch.uint8), q.global_scale)
    with pytest.raises(ValueError, match="unknown FP4 format"):
        F.QuantizedTensor("fp8", q.codes, q.scales, q.global_scale)
    m = F.quantize(torch.randn(4, 64), "mxfp4")
    bad = m.scales.clone()
    bad[1, 1] = 255                                   # the E8M0 NaN code
    with pytest.raises(ValueError, match="255"):
        F.dequantize(F.QuantizedTensor("mxfp4", m.codes, bad, None))
    with pytest.raises(ValueError, match="no global scale"):
        F.QuantizedTensor("mxfp4", m.codes, m.scales, torch.tensor(1.0))
    with pytest.raises(ValueError, match="apply_global_scale=False"):
        F.dequantize(F.QuantizedTensor("nvfp4", q.codes, q.scales, None))


def test_channels_and_global_scales_are_checked():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="integer"):
        F.quantize_with_residue(x, "nvfp4", channels=torch.tensor([1.7, 3.2]))
    with pytest.raises(ValueError, match="repeat"):
        F.quantize_with_residue(x, "nvfp4", channels=torch.tensor([3, 3]))
    base, res = F.quantize_with_residue(x, "nvfp4", channels=torch.tensor([5, 1]))
    assert res.shape[-1] == 16
    for bad in ([0.1, 0.2], "0.1", None.__class__):
        with pytest.raises(TypeError, match="global_scale"):
            F.quantize(x, "nvfp4", global_scale=bad)
    with pytest.raises(TypeError, match="one number"):
        F.quantize(x, "nvfp4", global_scale=torch.ones(2))
    with pytest.raises(ValueError, match="positive finite"):
        F.quantize(x, "nvfp4", global_scale=float("nan"))
    assert F.quantize(x, "nvfp4", global_scale=torch.tensor([0.5])).global_scale == 0.5


# -- item 9: the reference operators --------------------------------------------------------------
def _cache():
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(2, n, 64, generator=g) for n in (5, 9)]
    vs = [torch.randn(2, n, 64, generator=g) for n in (5, 9)]
    return PagedKVCache.from_dense(ks, vs, page_size=16)


def test_reference_decode_attention_refuses_bad_input():
    cache, bt, sl = _cache()
    q = torch.randn(2, 4, 64)
    ok = R.decode_attention(q, cache, bt, sl)
    assert ok.shape == (2, 4, 64) and bool(torch.isfinite(ok).all())
    nanq = q.clone()
    nanq[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        R.decode_attention(nanq, cache, bt, sl)
    with pytest.raises(ValueError, match="query_scale"):
        R.decode_attention(q, cache, bt, sl, query_scale="col")
    with pytest.raises(ValueError, match="seq_lens"):
        R.decode_attention(q, cache, bt, sl[:1])
    with pytest.raises(ValueError, match="seq_lens"):
        R.decode_attention(q, cache, bt[:1], sl)
    with pytest.raises(ValueError, match="exceeds its block table"):
        R.decode_attention(q, cache, bt, sl + 100)
    with pytest.raises(ValueError, match=r"\[B, Hq, D\]"):
        R.decode_attention(q[0], cache, bt, sl)
    with pytest.raises(ValueError, match="pv"):
        R.decode_attention(q, cache, bt, sl, pv="int8")


def test_reference_linear_edge_shapes():
    qw = prepare_weight(torch.randn(32, 64), "nvfp4")
    y = R.linear(torch.zeros(0, 64), qw)
    assert y.shape == (0, 32) and y.dtype == torch.float32
    assert R.linear(torch.zeros(2, 0, 64), qw, "full").shape == (2, 0, 32)
    with pytest.raises(ValueError, match="0-dim"):
        R.linear(torch.tensor(1.0), qw)
    with pytest.raises(ValueError, match="K=64"):
        R.linear(torch.zeros(3, 32), qw)


# -- item 6: checkpoints ---------------------------------------------------------------------------
def _ckpt(tmp_path, mutate=None, meta=None, fmt="nvfp4"):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "c.safetensors"
    w = torch.randn(32, 64)
    sel = select_channels(torch.rand(64), 0.25)
    save_layers(path, {"l": prepare_weight(w, fmt, sel, input_scale=0.01 if fmt == "nvfp4"
                                           else None)})
    if mutate or meta:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            md = dict(f.metadata())
        t = load_file(str(path))
        if mutate:
            mutate(t)
        if meta:
            meta(md)
        save_file(t, str(path), metadata=md)
    return path


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.update({"l.weight_scale": t["l.weight_scale"][:5]}), "rows"),
    (lambda t: t.update({"l.weight": t["l.weight"].reshape(2, 16, -1)}), "uint8 [N, K / 2]"),
    (lambda t: t.update({"l.weight_scale_2": torch.tensor(-1.0)}), "positive finite"),
    (lambda t: t.update({"l.weight_scale_2": torch.tensor(float("nan"))}), "positive finite"),
    (lambda t: t.update({"l.input_scale": torch.tensor(0.0)}), "positive finite"),
    (lambda t: t.update({"l.input_scale": torch.tensor(float("nan"))}), "positive finite"),
    (lambda t: t.pop("l.resgen_in_features"), "resgen_in_features is missing"),
    (lambda t: t.pop("l.weight_scale"), "weight_scale is missing"),
    (lambda t: t.pop("l.resgen_ratio"), "come together"),
    (lambda t: t.update({"l.resgen_ratio": torch.tensor(0.3)}), "ratio"),
])
def test_checkpoint_fields_are_validated(tmp_path, mutate, needle):
    path = _ckpt(tmp_path, mutate)
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        load_layers(path)
    assert str(path) in str(e.value) and "'l'" in str(e.value)


def test_checkpoint_metadata_and_files(tmp_path):
    assert set(load_layers(_ckpt(tmp_path))) == {"l"}
    with pytest.raises(ValueError, match="'resgen_layers' is missing"):
        load_layers(_ckpt(tmp_path, meta=lambda m: m.pop("resgen_layers")))
    with pytest.raises(ValueError, match="not JSON"):
        load_layers(_ckpt(tmp_path, meta=lambda m: m.update(resgen_layers="[")))
    with pytest.raises(ValueError, match="resgen_format"):
        load_layers(_ckpt(tmp_path, meta=lambda m: m.update(resgen_format="fp8")))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="not a safetensors checkpoint") as e:
        load_layers(junk)
    assert str(junk) in str(e.value)
    with pytest.raises(ValueError, match="no such checkpoint"):
        load_layers(tmp_path / "missing.safetensors")


# -- item 17: nits ---------------------------------------------------------------------------------
def test_selection_ratio_and_cache_geometry():
    masks = torch.full((8,), 0xFF, dtype=torch.uint8)
    assert Selection(masks, 1.0).k == 8
    with pytest.raises(ValueError, match="ratio"):
        Selection(masks, True)
    with pytest.raises(ValueError, match="ratio"):
        select_channels(torch.rand(64), True)
    for kw in (dict(num_kv_heads=0), dict(num_pages=0), dict(page_size=-1),
               dict(head_dim=100), dict(num_kv_heads=True)):
        args = dict(num_pages=2, num_kv_heads=2, head_dim=64, page_size=16)
        args.update(kw)
        with pytest.raises(ValueError):
            PagedKVCache.empty(**args)


def test_model_spec_ranges():
    with pytest.raises(ValueError, match="head_dim"):
        ModelSpec("m", hidden=1024, intermediate=2048, heads=8, kv_heads=8, head_dim=100,
                  layers=1)
    with pytest.raises(ValueError, match="features wide"):
        ModelSpec("m", hidden=1 << 21, intermediate=2048, heads=8, kv_heads=8, head_dim=128,
                  layers=1)


def test_an_xz_table_error_names_the_file_given(tmp_path, isolated_cache):  # noqa: F811
    import lzma

    from resgen.db import DatabaseError, TuningDB

    bad = tmp_path / "t.sqlite.xz"
    bad.write_bytes(lzma.compress(b"not sqlite" * 100))
    with pytest.raises(DatabaseError) as e:
        TuningDB(bad, readonly=True)
    assert str(bad) in str(e.value) and "tables" not in str(e.value).split(":")[0]
    json.dumps(str(e.value))
