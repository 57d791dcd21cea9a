"""The CuTe layouts of attention_sm100's MMA operands in shared memory: built once here, called by
the kernel template (templates/attention_sm100.py.j2, at trace time inside its @cute.jit entry)
and by the CPU test (tests/test_attention_sm100_layouts.py), which evaluates them element by
element against the loaders' hand maps (attention_sm100_geom.k_code_offset /
k_sf_word_offset, sm100_layout.sf_offset for the query's scale atom). So what the test proves
is about the very layouts the kernel's MMA descriptors are built from.

Call only while a @cute.jit function is being traced (the CuTe calls build IR); the layouts
are static (every shape and stride a Python int), so the host can read them back.

    QK (S = K Q^T): tcgen05.mma kind::mxf4nvf4 block16, M = KEYS = 128, N = qk_n, K = head_dim
        A  K codes      [KEYS, head_dim] E2M1, K-major swizzled (SW64 for 64-byte rows, SW128
                        for 128-byte rows: CUTLASS's heuristic atom for the K extent)
        B  query codes  [qk_n, head_dim] E2M1, K-major, the same atom
        SFA / SFB       E4M3 per 16 along K, the tcgen05 block-scaled scale-factor atom
                        (128 rows; SFB is 128 rows for every qk_n < 128)
    P.V (O_t = V^T P^T): tcgen05.mma kind::f16, M = 128 head dims per instruction, N = pv_n,
        K = KEYS
        A  V  [head_dim, KEYS] FP16, MN-major;  B  P  [pv_n, KEYS] FP16, K-major
"""

from __future__ import annotations

from typing import Any

__all__ = ["SF_VEC", "qk_tiler", "pv_tiler", "qk_layouts", "pv_layouts"]

SF_VEC = 16                # elements per scale factor (NVFP4, E4M3)


def qk_tiler(keys: int, qk_n: int, head_dim: int) -> tuple[int, int, int]:
    return (keys, qk_n, head_dim)


def pv_tiler(pv_m_tiles: int, pv_n: int, keys: int) -> tuple[int, int, int]:
    return (128 * pv_m_tiles, pv_n, keys)


def qk_layouts(keys: int, qk_n: int, head_dim: int) -> tuple[Any, Any, Any, Any, Any]:
    """(qk_mma, K codes smem layout, query codes smem layout, SFA smem layout, SFB smem layout):
    the tiled MMA of the QK product and its operands' one-stage shared-memory layouts (codes:
    ComposedLayout swizzle o offset o layout in E2M1 elements, the swizzle acting on byte
    addresses; scale factors: Layout in bytes)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    import cutlass.utils.blockscaled_layout as blockscaled_utils
    from cutlass.cute.nvgpu import tcgen05

    tiler = qk_tiler(keys, qk_n, head_dim)
    ab, sf = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN
    mma = cute.make_tiled_mma(tcgen05.MmaMXF4NVF4Op(sf, (keys, qk_n, 64), tcgen05.CtaGroup.ONE,
                                                    tcgen05.OperandSource.SMEM))
    return (mma, sm100_utils.make_smem_layout_a(mma, tiler, ab, 1),
            sm100_utils.make_smem_layout_b(mma, tiler, ab, 1),
            blockscaled_utils.make_smem_layout_sfa(mma, tiler, SF_VEC, 1),
            blockscaled_utils.make_smem_layout_sfb(mma, tiler, SF_VEC, 1))


def pv_layouts(keys: int, pv_n: int, pv_m_tiles: int, pv_k: int) -> tuple[Any, Any, Any]:
    """(pv_mma, V smem layout, P smem layout): the P.V product's tiled MMA (FP16 in, FP32
    accumulator, A MN-major, B K-major) and its operands' one-stage layouts (FP16 elements)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import tcgen05

    tiler = pv_tiler(pv_m_tiles, pv_n, keys)
    mma = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(cutlass.Float16, cutlass.Float32,
                                                   (128, pv_n, pv_k), tcgen05.CtaGroup.ONE,
                                                   tcgen05.OperandSource.SMEM,
                                                   cute.nvgpu.OperandMajorMode.MN,
                                                   cute.nvgpu.OperandMajorMode.K))
    return (mma, sm100_utils.make_smem_layout_a(mma, tiler, cutlass.Float16, 1),
            sm100_utils.make_smem_layout_b(mma, tiler, cutlass.Float16, 1))
