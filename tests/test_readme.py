"""The README says only what is true: its Python snippet runs as written (with a tiny model
folder for the path it names, on the CPU reference backend), every `resgen` command and flag
it writes exists in the command line's parser, and every repository path it cites exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:                       # argparse keeps sub-commands in one action
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _invocations(text: str) -> list[list[str]]:
    """Every `resgen ...` written in the text: in code spans and in code blocks, up to the end
    of the span or line (a table cell's escaped pipe is the alternative it is)."""
    spans = re.findall(r"`([^`\n]+)`", text)
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = spans + [ln for b in blocks for ln in b.splitlines()]
    out = []
    for ln in lines:
        for m in re.finditer(r"(?:^|[\s/(])resgen ((?:[a-z][\w-]*|\S+)(?: .*)?)$", ln):
            words = m.group(1).replace("\\|", "|").split("#")[0].split()
            out.append(words)
    return out


def _quality_help(name: str) -> str:
    """`resgen report --help` / `resgen plan --help` (resgen.quality.cli owns their flags)."""
    import contextlib
    import io

    from resgen.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main([name, "--help"])
    return buf.getvalue()


def test_every_command_and_flag_the_readme_writes_exists():
    from resgen.cli import build_parser

    top = _subparsers(build_parser())
    seen, bad = 0, []
    for words in _invocations(README):
        if not words or not re.fullmatch(r"[a-z]+", words[0]):
            continue                           # prose such as "resgen is ..."
        if words[0] not in top:
            if words[0] in ("makes", "is", "compiles"):
                continue
            bad.append(f"unknown command: resgen {' '.join(words)}")
            continue
        parsers = [top[words[0]]]
        rest = words[1:]
        if _subparsers(parsers[0]) and rest:
            names = rest[0].split("|")
            subs = _subparsers(parsers[0])
            if all(n in subs for n in names):
                parsers = [subs[n] for n in names]
                rest = rest[1:]
        for w in rest:
            if not w.startswith("--"):
                continue
            flag = w.split("=")[0].rstrip("`,;.)")
            for p in parsers:
                seen += 1
                if words[0] in ("report", "plan"):          # they parse their own flags
                    if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])",
                                     _quality_help(words[0])):
                        bad.append(f"resgen {words[0]}: no {flag}")
                elif flag not in p._option_string_actions:
                    bad.append(f"resgen {words[0]}: no {flag}")
    assert seen > 20, "the README's invocations were not found"
    assert not bad, bad


def test_every_path_the_readme_cites_exists():
    cited = set(re.findall(r"(?<![\w./-])((?:bench|docs|tuned|resgen|scripts|tests|\.ci)/"
                           r"[\w./-]*[\w])", README))
    cited |= {m for m in re.findall(r"\b(CONTRIBUTING\.md)\b", README)}
    missing = []
    for c in sorted(cited):
        path = ROOT / c
        if "*" in c or path.exists():
            continue
        # a module written with its package, e.g. resgen/ops/ or resgen/hf.py
        missing.append(c)
    assert not missing, missing


def _snippet() -> str:
    m = re.search(r"<!-- tests/test_readme.py runs this block[^\n]*-->\n```python\n(.*?)```",
                  README, flags=re.S)
    assert m, "the README's tested Python block is gone"
    return m.group(1)


def test_the_python_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    code = _snippet()
    assert '"path/to/hf-model"' in code
    vocab = 320
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, eos_token_id=2,
                                   bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    words = {f"w{i}": i for i in range(vocab)}
    tk = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0",
                                         eos_token="w2").save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    import logging

    logging.getLogger("resgen.runtime").setLevel(logging.ERROR)   # no tuned rows on a CPU
    exec(compile(code.replace('"path/to/hf-model"', repr(str(folder))), "README.md", "exec"),
         {"__name__": "__readme__"})
    printed = capsys.readouterr().out.strip()
    assert printed.endswith("tokens/s") and len(printed.split()) >= 3
