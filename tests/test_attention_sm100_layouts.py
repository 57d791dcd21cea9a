"""attention_sm100's hand-written shared-memory maps are the layouts CuTe describes to the QK MMA
(CPU only: CuTe DSL traces for sm_100a without a GPU). The loader threads write the K codes at
attention_sm100_geom.k_code_offset, the K scale words at k_sf_word_offset, the query codes at
k_code_offset (prologue) and the query's scale atom as bytes laid out by sm100_layout.sf_offset
(attention_sm100.query_operand, copied linearly), while tcgen05.mma reads them through the
descriptors CuTe builds from attention_sm100_layouts.qk_layouts, the function the template
calls. Here those very layouts are built for every (qk_n, head_dim) the family produces and
evaluated at every element of every operand: each element's byte (and nibble) must be the hand
map's, and the hand maps must be bijections onto CuTe's tiles.

How a layout is evaluated: the layouts are static, so their shapes and strides are read back
as Python ints and evaluated by CuTe's coordinate rule (colexicographic; the evaluator agrees
with cute.crd2idx on samples of every layout). The codes' layouts are ComposedLayouts
`swizzle o 0 o layout` in E2M1 elements whose swizzle acts on the BYTE address of the element
(CuTe's smem-pointer convention: the DSL builds the same S<B,4,3> for every element width;
test_swizzle_acts_on_byte_addresses shows it on the PTX of a store through a swizzled tensor),
so element e sits at byte swizzle(layout(e) // 2), nibble layout(e) % 2. Which (row, k) element
a fragment coordinate is comes from CuTe's own partition of an identity tensor (partition_A /
partition_B of the tiled MMA)."""

from __future__ import annotations

import re

import pytest

from resgen.kernels import attention_sm100_geom as G
from resgen.kernels.attention_sm100_geom import KEYS, AttnSm100Geometry
from resgen.kernels.sm100_layout import sf_offset
from resgen.search import attention_sm100 as A

ARCH = "sm_100a"
# the trace unrolls sampling loops of ~100 iterations on purpose (nothing is run)
pytestmark = pytest.mark.filterwarnings(
    "ignore::cutlass.base_dsl.ast_helpers.DSLOptimizationWarning")


def _family_shapes() -> list[tuple[int, int]]:
    """Every (qk_n, head_dim) of the family: head dims 128 / 256, groups 1..16, ResAttn / plain
    (qk_n 8, 16, 32)."""
    out = set()
    for d in A.HEAD_DIMS:
        for grp in range(1, A.MAX_GROUP + 1):
            for comp, ql in ((False, "plain"), (True, "pair"), (True, "half")):
                g = AttnSm100Geometry(head_dim=d, group=grp, page_size=32, compensation=comp,
                                      qlayout=ql, tmem_shape="32x32b", tmem_rep=8, stages=1,
                                      reduction="none")
                out.add((g.qk_n, d))
    return sorted(out)


SHAPES = _family_shapes()


def _crd2idx(crd, shape, stride):
    """CuTe's crd2idx for static (shape, stride): an int coordinate over a tuple mode is split
    colexicographically; tuples go mode by mode."""
    if isinstance(shape, tuple):
        if isinstance(crd, tuple):
            return sum(_crd2idx(c, s, d) for c, s, d in zip(crd, shape, stride))
        idx = 0
        for s, d in zip(shape, stride):
            n = _size(s)
            idx += _crd2idx(crd % n, s, d)
            crd //= n
        return idx
    return crd * stride


def _size(shape):
    if isinstance(shape, tuple):
        n = 1
        for s in shape:
            n *= _size(s)
        return n
    return shape


def _idx2crd(i, shape):
    """The natural (leaf by leaf, colexicographic) coordinate of index i in `shape`."""
    if isinstance(shape, tuple):
        out = []
        for s in shape:
            n = _size(s)
            out.append(_idx2crd(i % n, s))
            i //= n
        return tuple(out)
    return i


def _swizzle(spec: str):
    """The function of a CuTe swizzle S<B,M,S>: x ^ ((x >> S) & ((2^B - 1) << M))."""
    b, m, s = (int(x) for x in re.fullmatch(r"S<(\d+),(\d+),(\d+)>", spec).groups())
    mask = ((1 << b) - 1) << m
    return lambda x: x ^ ((x >> s) & mask)


def _static(x):
    """A static CuTe shape / stride as nested Python tuples of ints."""
    if isinstance(x, (tuple, list)):
        return tuple(_static(y) for y in x)
    return int(x)


@pytest.fixture(scope="module")
def traced():
    """Per (qk_n, head_dim): the template's QK layouts read back (shapes, strides, swizzles),
    CuTe's (row, k) of every fragment coordinate, and cute.crd2idx samples."""
    import cutlass
    import cutlass.cute as cute

    from resgen.kernels import attention_sm100_layouts as L

    got: dict = {}

    @cute.jit
    def trace():
        for qn, d in SHAPES:
            mma, k, q, sfa, sfb = L.qk_layouts(KEYS, qn, d)
            rec = {"str": [str(x) for x in (k, q, sfa, sfb)]}
            for name, lay in (("K", k), ("Q", q)):
                rec[name] = (_static(lay.outer.shape), _static(lay.outer.stride), str(lay.inner))
            for name, lay in (("SFA", sfa), ("SFB", sfb)):
                rec[name] = (_static(lay.shape), _static(lay.stride))
            # which (row, k) CuTe's MMA partition puts at each fragment coordinate
            thr = mma.get_slice(0)
            for name, part, rows in (("A", thr.partition_A, KEYS), ("B", thr.partition_B, qn)):
                c = part(cute.make_identity_tensor((rows, d)))
                rec["crd" + name] = (_static(c.layout.shape),
                                     [tuple(int(x) for x in c[i]) for i in range(cute.size(c))])
            samples = []
            for name, lay in (("K", k.outer), ("Q", q.outer), ("SFA", sfa), ("SFB", sfb)):
                for i in cutlass.range_constexpr(0, cute.size(lay), 97):
                    crd = _idx2crd(i, _static(lay.shape))
                    samples.append((name, i, int(cute.crd2idx(crd, lay))))
            # the composed layout as a function of element indices (the swizzle's bits)
            for i in cutlass.range_constexpr(0, cute.size(k), 61):
                crd = _idx2crd(i, _static(k.outer.shape))
                samples.append(("Kc", i, int(cute.crd2idx(crd, k))))
            rec["samples"] = samples
            got[(qn, d)] = rec

    cute.compile(trace, options=f"--gpu-arch {ARCH}")
    return got


def test_family_shapes_cover_the_cover_problems():
    cover = {(A.geometry_of(v, p).qk_n, p.head_dim) for p, v in A.covering_cases()}
    assert cover <= set(SHAPES) and {n for n, _ in SHAPES} == {8, 16, 32}


@pytest.mark.parametrize("qn, d", SHAPES)
def test_evaluator_is_cute_crd2idx(traced, qn, d):
    rec = traced[(qn, d)]
    assert len(rec["samples"]) > 100
    for name, i, want in rec["samples"]:
        if name == "Kc":
            shape, stride, sw = rec["K"]
            assert _swizzle(sw)(_crd2idx(i, shape, stride)) == want, (name, i)
        else:
            shape, stride = rec[name][:2]
            assert _crd2idx(i, shape, stride) == want, (name, i)


def _elements(rec, which):
    """(fragment coordinate index, row, k) of every element of operand A or B."""
    shape, crds = rec["crd" + which]
    assert len(crds) == _size(shape)
    return shape, crds


@pytest.mark.parametrize("qn, d", SHAPES)
@pytest.mark.parametrize("operand", ["K", "Q"])
def test_codes_hand_map_is_cutes_layout(traced, qn, d, operand):
    """K codes (A) and query codes (B): every E2M1 element (row, k) at byte
    k_code_offset(row, k // 32, D/2) + (k % 32) // 2, nibble k % 2 (the 16-byte chunks the
    loaders copy, low nibble = even element as formats.pack_fp4) is where CuTe's layout puts
    it; the map covers the tile exactly once."""
    rec = traced[(qn, d)]
    shape, stride, sw = rec[operand]
    swz = _swizzle(sw)
    rows = KEYS if operand == "K" else qn
    fshape, crds = _elements(rec, "A" if operand == "K" else "B")
    assert _size(shape) == _size(fshape) == rows * d
    rb = d // 2
    assert sw == {64: "S<2,4,3>", 128: "S<3,4,3>"}[rb]       # SW64 / SW128, the hand map's
    seen = set()
    unswizzled = 0
    for i, (r, k) in enumerate(crds):
        e = _crd2idx(i, shape, stride)
        cute_byte, cute_nib = swz(e // 2), e % 2
        hand = G.k_code_offset(r, k // 32, rb) + (k % 32) // 2
        assert (cute_byte, cute_nib) == (hand, k % 2), (operand, qn, d, r, k)
        seen.add((hand, k % 2))
        unswizzled += (e // 2) != cute_byte
    assert len(seen) == rows * d and max(seen)[0] == rows * rb - 1
    assert unswizzled > rows * d // 2          # the swizzle is exercised, not the identity


@pytest.mark.parametrize("qn, d", SHAPES)
def test_k_scale_words_are_cutes_sfa_layout(traced, qn, d):
    """SFA: the scale of K element (row, k) (group k // 16) is byte j = (k // 16) % 4 of the
    32-bit word the loader writes at k_sf_word_offset(row, k // 64, sf_cols) (the cache's 4
    scale bytes of the word, little-endian), at every element of the tile."""
    rec = traced[(qn, d)]
    shape, stride = rec["SFA"]
    _, crds = _elements(rec, "A")
    g = AttnSm100Geometry(head_dim=d, group=1, page_size=32, compensation=False,
                          qlayout="plain", tmem_shape="32x32b", tmem_rep=8, stages=1,
                          reduction="none")
    assert _size(shape) == KEYS * d
    seen = set()
    for r, k in crds:
        # SFA's mode 0 is (128 rows, 64 k) like A's: element (r, k) of MMA kb = k // 64
        hand = G.k_sf_word_offset(r, k // 64, g.sf_cols) + (k // 16) % 4
        assert _crd2idx(((r, k % 64), 0, k // 64, 0), shape, stride) == hand, (qn, d, r, k)
        seen.add(hand)
    assert seen == set(range(KEYS * d // 16))


@pytest.mark.parametrize("qn, d", SHAPES)
def test_query_scale_atom_is_cutes_sfb_layout(traced, qn, d):
    """SFB for qk_n < 128: CuTe's SFB tile is one 128-row atom whatever qk_n; the scale of query
    element (row, k), row < qk_n, is at sf_offset(row, k // 16, sf_cols), the byte
    attention_sm100.query_operand puts it at in its 128 x sf_cols buffer, which the prologue
    copies linearly (16-byte pieces at the same offsets)."""
    rec = traced[(qn, d)]
    shape, stride = rec["SFB"]
    _, crds = _elements(rec, "B")
    sf_cols = d // 16
    assert _size(shape) == 128 * d and len(crds) == qn * d
    for r, k in crds:
        # CuTe's SFB mode 0 is (128 rows, 64 k) for every qk_n: row r < qk_n of the B tile is
        # row r of the 128-row SF tile
        crd = ((r, k % 64), 0, k // 64, 0)
        assert _crd2idx(crd, shape, stride) == sf_offset(r, k // 16, sf_cols), (qn, d, r, k)
    # the buffer the host fills is exactly the SF tile CuTe lays out (cosize 128 sf_cols)
    cos = 1 + sum((s - 1) * dd for s, dd in zip(_flat(shape), _flat(stride)))
    assert cos == 128 * sf_cols


def _flat(t):
    if isinstance(t, tuple):
        return [y for x in t for y in _flat(x)]
    return [t]


def test_swizzle_acts_on_byte_addresses():
    """CuTe DSL applies a pointer's swizzle to the byte address: a store of FP16 element 1000
    through an S<3,4,3>-swizzled tensor (1024-aligned) is at byte 2000 ^ 112 = 1952 (a swizzle
    of element indices would give 2 (1000 ^ 16) = 1968). So an E2M1 element's byte is the
    swizzle of (element offset) / 2, which is how the tests above evaluate the code layouts."""
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def kern():
        smem = cutlass.memory.SmemAllocator()
        buf = smem.allocate_tensor(cutlass.Float16, cute.make_layout(4096), byte_alignment=1024)
        t = cute.make_tensor(cute.recast_ptr(buf.iterator, swizzle_=cute.make_swizzle(3, 4, 3)),
                             cute.make_layout(4096))
        t[1000] = cutlass.Float16(1.0)

    @cute.jit
    def entry():
        kern().launch(grid=(1, 1, 1), block=(32, 1, 1))

    ptx = cute.compile(entry, options=f"--gpu-arch {ARCH} --keep-ptx").artifacts.PTX
    m = re.search(r"add\.s32\s+(%r\d+), %r\d+, (\d+);\s+xor\.b32\s+(%r\d+), \1, (\d+);\s+"
                  r"st\.shared\.b16\s+\[\3\]", ptx)
    assert m, ptx[-2000:]
    assert (int(m.group(2)), int(m.group(4))) == (2000, 112)
    assert _swizzle("S<3,4,3>")(2000) == 1952 != 2 * _swizzle("S<3,4,3>")(1000)
