"""Reading committed benchmark files, plain or xz-compressed (bench/results/h200 keeps large raw
results as NAME.xz to fit the device call's carry; see tests/test_repo_footprint.py)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any


def read_text(path: Path) -> str:
    """The file's text; decompressed when its name ends in .xz."""
    raw = Path(path).read_bytes()
    return (lzma.decompress(raw) if Path(path).suffix == ".xz" else raw).decode()


def ncu_number(s: str) -> float | None:
    """A number of an Nsight Compute CSV cell ("1,234.5" -> 1234.5); None where the cell holds
    no number (ncu writes "-" or text there)."""
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def load_json(path: Path) -> Any:
    """A JSON report, plain or xz-compressed."""
    return json.loads(read_text(path))


def mode(problem: dict[str, Any]) -> str:
    """A `resgen bench` row's mode, as `resgen bench` prints it: the compensation, with
    "+presum" for a K-Ext presum workload (its key's "fold"), so the two K-Ext folds stay
    apart."""
    comp = str(problem["compensation"])
    return comp + "+presum" if problem.get("fold") == "presum" else comp
