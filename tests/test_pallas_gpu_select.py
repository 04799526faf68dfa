"""The Mosaic GPU block-selection kernel (nsa/pallas/gpu/select.py), on the CPU.

No GPU here and GPU interpret mode cannot run wgmma, so the kernel itself is only lowered: exported for cuda
(jax.export, platforms=["cuda"]), which runs Mosaic GPU's layout inference and TMA checks and must give a
mosaic_gpu custom call, for G = 16, 3 and 24 (unused tile rows), head dims 128 and 16 (padded to 64), lse given
and None, with kv_lens, with cu_seqlens (concrete and traced), float16, and at the standard shape (jax >= 0.11
only: the CI's Python 3.11 run has jax 0.10.2). Everything around the kernel runs here against the reference:
the kernel's inputs in its tile layout (`_padded_inputs`, `_row_ranges`, `_lse_rows`) go through a plain-jnp
emulation of its math, whose scores `forward` turns into block ids that must equal the reference's; and
`indices_from_scores` alone, fed the reference's own scores, must give exactly its ids. The top-k kernel
(`top_k`: no wgmma) runs here in Mosaic GPU's interpret mode (jax >= 0.11), on hostile ranks (ties within and
across chunks, -inf rows, more slots than columns, ragged rows and columns) and inside `forward`; with older jax
`forward` takes the reference's `top_blocks` in its place. The run on the H200 is scripts/gpu_check_select.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from nsa._plan import num_candidates
from nsa._varlen import cdiv, num_compressed_blocks, tokens
from nsa.pallas.gpu import select as gpu_select
from nsa.reference import select as reference
from nsa.reference.compressed import softmax_over_blocks
from tests.base import MOSAIC_GPU_LOWERS

TOP_CHUNK = gpu_select.Config().top_chunk

CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200)
needs_mosaic_gpu = pytest.mark.skipif(
    not MOSAIC_GPU_LOWERS, reason=f"jax {jax.__version__} has no Mosaic GPU lowering for plgpu.kernel on a CPU "
                                  "machine (it needs jax >= 0.11)")


@pytest.fixture
def top_k_on_cpu(monkeypatch):
    """The reference's top_blocks in the place of the top-k kernel (interpreting it takes about a minute for
    forward's hundreds of rows; test_top_k_kernel_interpreted and test_forward_with_the_top_k_interpreted run it)."""
    monkeypatch.setattr(gpu_select, "top_k", lambda x, k, chunks, **_: reference.top_blocks(x, k))


def _inputs(B, T, HQ, H, Dk, block_size, dtype, cu=None, num_rows=None, seed=0, stride=None):
    """q [B, T, HQ, Dk] and k_cmp [B, NC, H, Dk] (one row every `stride` tokens, None: block_size) in `dtype`,
    random normal."""
    rng = np.random.default_rng(seed)
    NC = num_rows if num_rows is not None else num_compressed_blocks(T, stride or block_size, cu)
    return (jnp.asarray(rng.standard_normal((B, T, HQ, Dk)), dtype),
            jnp.asarray(rng.standard_normal((B, NC, H, Dk)), dtype))


def _lse(q, k_cmp, block_size, cu, kv_lens, stride=None):
    """Compressed attention's lse [B, T, HQ] of the float32 copies (the reference's; windows of block_size tokens
    every `stride`, None: block_size)."""
    stride = stride or block_size
    tok = tokens(q.shape[1], stride, cu, kv_lens)
    _, lse, _ = softmax_over_blocks(q.astype(jnp.float32), k_cmp.astype(jnp.float32), tok.pos, tok.cmp_start,
                                    block_size=block_size, stride=stride, scale=q.shape[-1] ** -0.5)
    return lse.reshape(q.shape[:3])


# ------------------------------------------------------------------------------------------ export for cuda

# (B, T, HQ, H, Dk, block_size), dtype, block_counts, lse given, cu_seqlens, kv_lens (NC rows of cache)
EXPORTS = {
    "G16-dk128-lse": ((1, 200, 16, 1, 128, 16), jnp.bfloat16, 4, True, None, None),
    "G16-dk128-H2": ((1, 200, 32, 2, 128, 16), jnp.bfloat16, 4, False, None, None),
    "G3-dk16": ((1, 100, 3, 1, 16, 16), jnp.bfloat16, 3, False, None, None),
    "G3-dk16-lse": ((1, 100, 3, 1, 16, 16), jnp.bfloat16, 3, True, None, None),
    "G3-dk16-kv_lens": ((2, 40, 6, 2, 16, 16), jnp.bfloat16, 4, False, None, 24),
    "G16-dk128-kv_lens-lse": ((2, 40, 32, 2, 128, 16), jnp.bfloat16, 4, True, None, 24),
    "G16-dk128-cu_seqlens": ((1, 200, 16, 1, 128, 16), jnp.bfloat16, 4, False, CU, None),
    "G16-dk128-cu_seqlens-traced-lse": ((1, 200, 16, 1, 128, 16), jnp.bfloat16, 4, True, "traced", None),
    "G24-unused-rows-f16": ((1, 50, 24, 1, 64, 8), jnp.float16, 3, False, None, None),
    "standard-8k-lse": ((1, 8192, 64, 4, 128, 64), jnp.bfloat16, 16, True, None, None),
}


@needs_mosaic_gpu
@pytest.mark.parametrize("name", list(EXPORTS))
def test_exports_for_cuda(name):
    (B, T, HQ, H, Dk, bs), dtype, S, with_lse, cu, cache_rows = EXPORTS[name]
    NC = cache_rows if cache_rows is not None else num_compressed_blocks(T, bs, None if cu is None else CU)
    args = [jax.ShapeDtypeStruct((B, T, HQ, Dk), dtype), jax.ShapeDtypeStruct((B, NC, H, Dk), dtype),
            jax.ShapeDtypeStruct((B, T, HQ), jnp.float32) if with_lse else None,
            jax.ShapeDtypeStruct(CU.shape, jnp.int32) if isinstance(cu, str) else None,
            jax.ShapeDtypeStruct((B,), jnp.int32) if cache_rows is not None else None]
    concrete_cu = jnp.asarray(cu) if isinstance(cu, np.ndarray) else None

    def f(q, k_cmp, lse, traced_cu, kv_lens):
        return gpu_select.forward(q, k_cmp, lse, concrete_cu if traced_cu is None else traced_cu, kv_lens,
                                  block_counts=S, block_size=bs, scale=Dk ** -0.5)

    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == (B, T, H, S) and exported.out_avals[0].dtype == jnp.int32


def test_rejects_float32_and_mixed_dtypes():
    q, k_cmp = _inputs(1, 32, 2, 1, 16, 8, jnp.float32)
    kw = dict(block_counts=2, block_size=8, scale=0.25)
    with pytest.raises(TypeError, match="float32"):
        gpu_select.forward(q, k_cmp, None, None, **kw)
    with pytest.raises(TypeError, match="k_cmp"):
        gpu_select.forward(q.astype(jnp.bfloat16), k_cmp.astype(jnp.float16), None, None, **kw)


def test_rejects_groups_over_64():
    q, k_cmp = _inputs(1, 32, 65, 1, 16, 8, jnp.bfloat16)
    with pytest.raises(ValueError, match="q: expected at most 64 query heads per KV head .* got G = HQ / H = 65"):
        gpu_select.forward(q, k_cmp, None, None, block_counts=2, block_size=8, scale=0.25)


# ------------------------------------------------------------------------------------------ around the kernel


def _emulated_scores(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_size, stride, scale):
    """`gpu_select.scores` in plain jnp on the kernel's own inputs (its tile layout): per program the 64 rows
    of TB tokens x GR head slots (a token past T reads token T - 1), logits against every row of the padded
    k_cmp masked by the rows' [first, end), p = exp(s - lse) or the softmax, then the mean of each token's G
    head rows: float32 [B, H, NT * TB, NCP]."""
    B, T, HQ, _ = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // H
    GR = gpu_select._head_slots(G)
    TB = gpu_select.ROWS // GR
    NT = cdiv(T, TB)
    q5, k_p = gpu_select._padded_inputs(q, k_cmp, H)
    rows = q5[:, jnp.minimum(jnp.arange(NT * TB), T - 1)].astype(jnp.float32)  # [B, NT * TB, H, GR, Dp]
    rows = jnp.transpose(rows.reshape(B, NT, TB, H, GR, -1), (0, 3, 1, 2, 4, 5)).reshape(B, H, NT, TB * GR, -1)
    rows = jnp.pad(rows, [(0, 0)] * 3 + [(0, gpu_select.ROWS - TB * GR), (0, 0)])  # [B, H, NT, 64, Dp]
    ranges = gpu_select._row_ranges(T, NC, G, block_size, stride, cu_seqlens, kv_lens)  # [R, NT, 2, 64]
    key = jnp.arange(k_p.shape[1])
    visible = ((key >= ranges[:, None, :, 0, :, None]) & (key < ranges[:, None, :, 1, :, None]))
    s = jnp.einsum("bhnrd,bchd->bhnrc", rows, k_p.astype(jnp.float32), precision="highest")
    s = jnp.where(visible, s * scale, -jnp.inf)
    if lse is not None:
        lse_rows = gpu_select._lse_rows(lse, H, G)[..., None]  # [B, H, NT, 64, 1]
        seen = lse_rows > -jnp.inf
        p = jnp.where(visible & seen, jnp.exp(s - jnp.where(seen, lse_rows, 0.0)), 0.0)
    else:
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        e = jnp.where(visible, jnp.exp(s - m), 0.0)
        total = jnp.sum(e, axis=-1, keepdims=True)
        p = e / jnp.where(total > 0, total, 1.0)
    p = p[:, :, :, :TB * GR].reshape(B, H, NT, TB, GR, -1)[:, :, :, :, :G]
    return (jnp.sum(p, axis=4) / G).reshape(B, H, NT * TB, -1)


def _reference(q, k_cmp, lse, cu, kv_lens, block_counts, block_size, **compression):
    return np.asarray(reference.forward(q.astype(jnp.float32), k_cmp.astype(jnp.float32), lse, cu, kv_lens,
                                        block_counts=block_counts, block_size=block_size,
                                        scale=q.shape[-1] ** -0.5, **compression))


# (B, T, HQ, H, Dk, block_size), block_counts, lse given, cu_seqlens, kv_lens
AROUND = {
    "G16-dk128": ((1, 300, 16, 1, 128, 16), 4, False, None, None),
    "G16-dk128-lse": ((1, 300, 16, 1, 128, 16), 4, True, None, None),
    "G3-dk16-H2": ((1, 100, 6, 2, 16, 8), 5, False, None, None),
    "G3-dk16-lse-more-slots-than-blocks": ((1, 30, 3, 1, 16, 8), 9, True, None, None),
    "G24-unused-rows": ((1, 50, 24, 1, 64, 8), 3, False, None, None),
    "G2-cu_seqlens": ((1, 200, 4, 2, 16, 16), 4, False, CU, None),
    "G2-cu_seqlens-lse": ((1, 200, 4, 2, 16, 16), 4, True, CU, None),
    "G2-kv_lens": ((2, 100, 4, 2, 16, 16), 4, False, None, np.array([100, 57], np.int32)),
    "G2-kv_lens-lse": ((2, 100, 4, 2, 16, 16), 4, True, None, np.array([100, 57], np.int32)),
}


# compression windows of l tokens every d under selection blocks of l' (Eq. 9): name -> (a case of AROUND with
# block_size l', (l, d))
AROUND_EQ9 = {
    "G2-l8-d4-bs16": (((1, 300, 4, 2, 16, 16), 5, False, None, None), (8, 4)),
    "G3-l16-d8-bs32-lse-cu_seqlens": (((1, 200, 6, 2, 16, 32), 4, True, CU, None), (16, 8)),
    "G2-l8-d4-bs16-kv_lens": (((2, 100, 4, 2, 16, 16), 4, True, None, np.array([100, 57], np.int32)), (8, 4)),
}


@pytest.mark.parametrize("name", list(AROUND) + list(AROUND_EQ9))
def test_forward_around_an_emulated_kernel(name, monkeypatch, top_k_on_cpu):
    """forward's XLA side (the kernel's inputs, then ids from its scores) with the kernel emulated in jnp: the
    reference's ids, rank order too; with overlapping windows (AROUND_EQ9) the Eq. 9 sum in XLA. With kv_lens the
    cache has the rows of 128 tokens, NaN past each sequence's complete windows."""
    ((B, T, HQ, H, Dk, bs), S, with_lse, cu, kv_lens), (l, d) = AROUND_EQ9.get(name, (AROUND.get(name), (None,) * 2))
    compression = {} if l is None else dict(compress_block_size=l, compress_stride=d)
    l, d = l or bs, d or bs
    NC = 128 // d if kv_lens is not None else None
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, jnp.bfloat16, cu, NC, stride=d)
    if kv_lens is not None:  # a cache's rows past each sequence's complete windows: never read
        unwritten = jnp.arange(NC)[None, :] * d + l > jnp.asarray(kv_lens)[:, None]
        k_cmp = jnp.where(unwritten[:, :, None, None], jnp.nan, k_cmp).astype(k_cmp.dtype)
        kv_lens = jnp.asarray(kv_lens)
    lse = _lse(q, k_cmp, l, cu, kv_lens, d) if with_lse else None
    monkeypatch.setattr(gpu_select, "scores", _emulated_scores)
    got = gpu_select.forward(q, k_cmp, lse, cu, kv_lens, block_counts=S, block_size=bs, scale=Dk ** -0.5,
                             **compression)
    assert got.dtype == jnp.int32 and got.shape == (B, T, H, S)
    np.testing.assert_array_equal(np.asarray(got), _reference(q, k_cmp, lse, cu, kv_lens, S, bs, **compression))


def _reference_scores(q, k_cmp, lse, cu, kv_lens, block_size):
    """The reference's score of each row of k_cmp, [B, T, H, NC] float32 (0 where not seen)."""
    tok = tokens(q.shape[1], block_size, cu, kv_lens)
    lse = None if lse is None else lse
    p, _, _ = softmax_over_blocks(q.astype(jnp.float32), k_cmp.astype(jnp.float32), tok.pos, tok.cmp_start, lse,
                                  block_size=block_size, stride=block_size, scale=q.shape[-1] ** -0.5)
    return jnp.mean(p, axis=3)


@pytest.mark.parametrize("name", ["G16-dk128", "G3-dk16-lse-more-slots-than-blocks", "G2-cu_seqlens",
                                  "G2-kv_lens-lse"])
def test_indices_from_scores_is_the_reference(name):
    """indices_from_scores on the reference's own scores: exactly the reference's ids."""
    (B, T, HQ, H, Dk, bs), S, with_lse, cu, kv_lens = AROUND[name]
    NC = 128 // bs if kv_lens is not None else None
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, jnp.float32, cu, NC)
    kv_lens = None if kv_lens is None else jnp.asarray(kv_lens)
    lse = _lse(q, k_cmp, bs, cu, kv_lens) if with_lse else None
    by_row = _reference_scores(q, k_cmp, lse, cu, kv_lens, bs)
    got = gpu_select.indices_from_scores(by_row, cu, kv_lens, block_counts=S, block_size=bs,
                                         num_blocks=num_candidates(T, k_cmp.shape[1], bs, kv_lens))
    np.testing.assert_array_equal(np.asarray(got), _reference(q, k_cmp, lse, cu, kv_lens, S, bs))


def test_indices_from_scores_traced_cu_seqlens():
    """Under jit with cu_seqlens an argument (traced): the same ids as with it concrete."""
    q, k_cmp = _inputs(1, 200, 4, 2, 16, 16, jnp.float32, CU)
    by_row = _reference_scores(q, k_cmp, None, CU, None, 16)
    kw = dict(block_counts=4, block_size=16, num_blocks=num_candidates(200, k_cmp.shape[1], 16, None))
    traced = jax.jit(lambda s, cu: gpu_select.indices_from_scores(s, cu, None, **kw))(by_row, jnp.asarray(CU))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(gpu_select.indices_from_scores(by_row, CU, **kw)))


def test_no_rows_gives_the_forced_blocks_only(top_k_on_cpu):
    """k_cmp with no rows (T shorter than a block, kv_lens None): only the current block, no scores kernel."""
    q = jnp.zeros((1, 5, 2, 16), jnp.bfloat16)
    k_cmp = jnp.zeros((1, 0, 1, 16), jnp.bfloat16)
    got = gpu_select.forward(q, k_cmp, None, None, block_counts=2, block_size=8, scale=0.25)
    np.testing.assert_array_equal(np.asarray(got), np.tile(np.array([0, -1], np.int32), (1, 5, 1, 1)))


@pytest.mark.parametrize("cu", [None, CU * 10], ids=["batch", "cu_seqlens"])
def test_chunk_bands_cover_exactly_the_visible_chunks(cu):
    """Each tile walks from the first to the last chunk of 64 compressed rows that any of its rows sees (the
    scores of the other chunks are never written)."""
    T, NC, G, bs = 2000, 125, 3, 16
    ranges = np.asarray(gpu_select._row_ranges(T, NC, G, bs, bs, None if cu is None else jnp.asarray(cu), None))
    bands = np.asarray(gpu_select._chunk_bands(jnp.asarray(ranges)))
    for r in range(ranges.shape[0]):
        for i in range(ranges.shape[1]):
            chunks = {row // gpu_select.CHUNK for first, end in zip(*ranges[r, i]) for row in range(first, end)}
            want = (min(chunks), max(chunks)) if chunks else (0, -1)
            assert tuple(bands[r, i]) == want, (r, i)


# R, N, k, ranks: random, ties (values on a grid of 4, so ties within and across chunks), or equal (one value
# everywhere but every 7th column)
TOP_K = {
    "small": (5, 7, 3, "random"),
    "one-tile-ties": (64, 128, 8, "ties"),
    "ragged-ties-k20": (130, 260, 20, "ties"),
    "more-slots-than-columns": (64, 40, 50, "random"),
    "one-entry": (1, 1, 1, "random"),
    "equal-values": (66, 500, 16, "equal"),
}


@needs_mosaic_gpu
@pytest.mark.parametrize("name", list(TOP_K))
def test_top_k_kernel_interpreted(name):
    """The top-k kernel in Mosaic GPU's interpret mode: exactly the reference's `top_blocks` (rank order, ties to
    the lower column, -1 for -inf), with every third row -inf past half its columns, every fifth all -inf, and
    the tiles' chunk counts cut to the columns that are not -inf where a whole tile allows it. The interpreter's
    race detector runs too (it finds the race when the load of a chunk is not followed by commit_smem before the
    next copy into its buffer)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races  # jax 0.11's own tool
    R, N, k, kind = TOP_K[name]
    rng = np.random.default_rng(1)
    x = rng.random((R, N)).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 4) / 4
    if kind == "equal":
        x[:] = 0.5
        x[:, ::7] = 0.25
    x[::3, N // 2:] = -np.inf
    x[1::5] = -np.inf
    tiles = cdiv(R, gpu_select.TOP_ROWS)
    finite = np.pad(np.isfinite(x), [(0, tiles * gpu_select.TOP_ROWS - R), (0, 0)]).reshape(tiles, -1, N)
    last = np.array([np.max(np.nonzero(t.any(axis=0))[0], initial=-1) for t in finite])
    chunks = (last // TOP_CHUNK + 1).astype(np.int32)
    interpret = plgpu.InterpretGPUParams(detect_races=True)
    got = gpu_select.top_k(jnp.asarray(x), k, jnp.asarray(chunks), interpret=interpret)
    assert got.dtype == jnp.int32 and got.shape == (R, k)
    assert not get_races().races_found
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference.top_blocks(jnp.asarray(x), k)))


@needs_mosaic_gpu
def test_forward_with_the_top_k_interpreted(monkeypatch):
    """forward with the scores kernel emulated and the top-k kernel interpreted (one tile of rows): the
    reference's ids."""
    (B, T, HQ, H, Dk, bs), S, _, cu, _ = AROUND["G3-dk16-lse-more-slots-than-blocks"]
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, jnp.bfloat16, cu)
    monkeypatch.setattr(gpu_select, "scores", _emulated_scores)
    monkeypatch.setattr(gpu_select, "top_k", functools.partial(gpu_select.top_k, interpret=plgpu.InterpretGPUParams()))
    got = gpu_select.forward(q, k_cmp, None, cu, None, block_counts=S, block_size=bs, scale=Dk ** -0.5)
    np.testing.assert_array_equal(np.asarray(got), _reference(q, k_cmp, None, cu, None, S, bs))


# B, T, H, block_size, cu_seqlens, kv_lens, NC: 375 blocks of 8 tokens, 3 chunks of ranks
TOP_CHUNKS = {
    "batch": (2, 3000, 2, 8, None, None, 375),
    "cu_seqlens": (1, 3000, 2, 8, np.array([0, 1100, 1100, 2999, 3000], np.int32), None, 375),
    "kv_lens": (2, 50, 3, 8, None, np.array([3000, 1100], np.int32), 375),
}


@pytest.mark.parametrize("name", list(TOP_CHUNKS))
def test_top_chunks_cover_every_finite_rank(name):
    """`_top_chunks`: every rank a tile's chunks leave out is -inf, and each tile walks exactly the chunks up to
    its last finite rank."""
    B, T, H, bs, cu, kv_lens, NC = TOP_CHUNKS[name]
    kv_lens = None if kv_lens is None else jnp.asarray(kv_lens)
    nb = num_candidates(T, NC, bs, kv_lens)
    by_row = jnp.asarray(np.random.default_rng(0).random((B, T, H, NC)), jnp.float32)
    ranks = np.asarray(gpu_select.ranks_from_scores(by_row, cu, kv_lens, block_size=bs, num_blocks=nb))
    chunks = np.asarray(gpu_select._top_chunks(tokens(T, bs, cu, kv_lens).pos, B, H, bs, nb, TOP_CHUNK))
    rows = np.pad(ranks.reshape(B * T * H, nb), [(0, chunks.size * gpu_select.TOP_ROWS - B * T * H), (0, 0)],
                  constant_values=-np.inf).reshape(chunks.size, gpu_select.TOP_ROWS, nb)
    col = np.arange(nb)
    assert len(set(chunks.tolist())) > 1  # the cases reach several chunk counts
    for tile, n in zip(rows, chunks):
        assert np.all(tile[:, col >= n * TOP_CHUNK] == -np.inf)
        assert n == np.max(col[np.isfinite(tile).any(axis=0)]) // TOP_CHUNK + 1
