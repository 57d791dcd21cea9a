"""Can resgen's kernels serve a linear layer of this shape? (asked of the kernel families)

A layer is servable when some registered linear family for the arch accepts the problem with
its default variant (the runtime's fallback on a dispatch miss: resgen.runtime), so a layer that
passes here always runs, tuned or not. The format itself needs K % 16 (NVFP4) / K % 32 (MXFP4),
which a checkpoint's scale shapes already guarantee.
"""

from __future__ import annotations

__all__ = ["why_unservable"]


def why_unservable(fmt: str, n: int, k: int, compensation: str = "none",
                   arch: str | None = None) -> str | None:
    """None if resgen can serve y = x W^T with W: [n, k] in `fmt`, else the reasons (one line).

    compensation: "none" | "full" | a K-Ext ratio string ("0.125", ...); arch: default
    resgen.settings' (the GPU's, else RESGEN_ARCH, else sm_90a).
    """
    from ..settings import settings

    arch = arch or settings().arch
    from .. import formats
    from ..search.family import families_for
    from ..search.variant import LinearProblem

    bs = formats.block_size(fmt)
    if k % bs:
        return f"K={k} is not a multiple of the {fmt} block of {bs}"
    try:
        p = LinearProblem(fmt, compensation, 1, int(n), int(k), True)
    except (ValueError, TypeError) as e:
        return f"not a valid linear problem: {e}"
    reasons = []
    for fam in sorted(families_for("linear", arch), key=lambda f: f.NAME):
        if fam.PROBLEM is not LinearProblem:
            continue
        try:
            d = fam.default(p, arch)
            why = fam.why_invalid(d, p, arch)
        except (ValueError, StopIteration) as e:
            why = str(e) or type(e).__name__
        if why is None:
            return None
        reasons.append(f"{fam.NAME}: {_short(why)}")
    if not reasons:
        return f"no linear kernel family for {arch}"
    return "; ".join(reasons)


def _short(why: str) -> str:
    # family errors repeat the problem key ("... cannot run {json}: reason"); keep the reason
    head, sep, tail = why.rpartition("}: ")
    return tail if sep else why
