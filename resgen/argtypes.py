"""argparse value types shared by resgen's command lines (resgen.cli, resgen generate,
resgen quantize): each turns one argument into a value or raises argparse's
ArgumentTypeError, which argparse prints as one usage line (exit 2)."""

from __future__ import annotations

import argparse

__all__ = ["positive_int"]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return v
