"""What a bench/ entry point records about its own run, the same fields in every JSON report:
the command line that reproduces it (the RESGEN_* / OUT environment variables it was given
written in front), the script, the date, the git commit where the checkout has one (a device
call copies the working tree without .git: then null), and the measurement policy by name and
in full where the script times anything.

    REPORT["run"] = run_record(__file__, argv, policy=DEFAULT_POLICY)
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
# the environment a bench script may read (bench/README.md): recorded when set
ENV_NAMES = ("OUT", "CUDA_VISIBLE_DEVICES")


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _policy_dict(policy: Any) -> dict[str, Any] | None:
    if policy is None:
        return None
    if hasattr(policy, "as_dict"):
        return {"label": getattr(policy, "label", None), **policy.as_dict()}
    return dict(policy)


def run_record(script: str | os.PathLike, argv: Sequence[str] | None = None, *,
               policy: Any = None, **extra: Any) -> dict[str, Any]:
    """The record of this run. script: the entry point's __file__; argv: its arguments
    (default sys.argv[1:]); policy: a resgen.search.timing.MeasurementPolicy (or a plain
    dict) when the script times kernels; extra: further fields (e.g. budgets)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = Path(script).resolve()
    try:
        rel = path.relative_to(ROOT).as_posix()
    except ValueError:
        rel = str(path)
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("RESGEN_") or k in ENV_NAMES}
    # OUT only says where the files went: not part of the command that reproduces them
    prefix = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k != "OUT"]
    command = " ".join([*prefix, "python3", rel, *map(shlex.quote, argv)])
    return {"command": command, "script": rel, "argv": argv, "env": env,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "policy": _policy_dict(policy), **extra}
