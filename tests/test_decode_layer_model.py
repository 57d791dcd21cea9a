"""bench/report/decode_layer_model.py: the per-layer sums are the committed reports' numbers added
up (recomputed here from the raw rows for one point), every model x batch x KV point where
both reports measured is listed, and the markdown it writes is the committed one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH / "report"))

import decode_layer_model as D  # noqa: E402
from report_io import load_json  # noqa: E402


@pytest.fixture(scope="module")
def inputs():
    if not all(p.exists() for p in [*D.LINEAR.values(), D.ATTENTION]):
        pytest.skip("committed H200 reports not present")
    linear = {m: D.linear_sums(load_json(p)) for m, p in D.LINEAR.items()}
    return linear, D.attention_times(load_json(D.ATTENTION))


def test_one_point_recomputed_from_the_raw_rows(inputs):
    linear, attention = inputs
    rows = {(m, b, kv): r for (m, b, kv, *r) in D.model_rows(linear, attention)}
    rep = load_json(D.LINEAR["qwen3-8b"])
    lin = [r for r in rep["rows"] if r["problem"]["fmt"] == "nvfp4"
           and r["problem"]["m"] == 32 and r["check"]["ok"]]
    none = [r for r in lin if r["problem"]["compensation"] == "none"]
    full = [r for r in lin if r["problem"]["compensation"] == "full"]
    assert len(none) == len(full) == 4
    att = next(c for c in load_json(D.ATTENTION)["configs"]
               if (c["geom"], c["batch"], c["kv_len"]) == ("qwen3-8b", 32, 32768))
    bf16, plain, comp = rows[("qwen3-8b", 32, 32768)]
    assert bf16 == pytest.approx(sum(r["bf16_us"] for r in none) + att["sdpa"]["gqa"]["us"])
    assert plain == pytest.approx(sum(r["resgen_us"] for r in none)
                                  + att["table"]["plain"]["us"])
    assert comp == pytest.approx(sum(r["resgen_us"] for r in full)
                                 + att["table"]["resattn"]["us"])


def test_every_measured_point_is_listed_and_the_committed_table_is_current(inputs, tmp_path):
    linear, attention = inputs
    rows = D.model_rows(linear, attention)
    assert {(m, b) for m, b, *_ in rows} == {(m, b) for m in D.LINEAR for b in D.BATCHES}
    assert len(rows) == len(D.LINEAR) * len(D.BATCHES) * 3         # KV 8K, 32K, 128K
    out = tmp_path / "m.md"
    assert D.main(["--out", str(out)]) == 0
    committed = D.RESULTS / "decode_layer_model.md"
    assert committed.exists() and out.read_text() == committed.read_text()
