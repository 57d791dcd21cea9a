"""The one exception type of checkpoint import and export."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint (or a request about one) that resgen cannot read, write or serve.

    The message names the file, the tensor (or module) and the problem; `file`, `tensor` and
    `problem` keep them apart for callers. A ValueError, so code that catches bad input as
    ValueError keeps working.
    """

    def __init__(self, problem: str, *, file: str | Path | None = None,
                 tensor: str | None = None) -> None:
        self.problem = problem
        self.file = None if file is None else str(file)
        self.tensor = tensor
        where = []
        if self.file is not None:
            where.append(self.file)
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(": ".join([*where, problem]) if where else problem)
