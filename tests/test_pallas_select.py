"""The Pallas TPU block-selection kernel (nsa/pallas/tpu/select.py).

On the CPU it runs in Pallas's TPU interpret mode (race detection on) and must return exactly the XLA
reference's block ids, in the reference's rank order: G = 1, 3 and 16, head dims that are not a multiple of
128 lanes, T not a multiple of the token tile, block_counts 1, 3 and more than the blocks, compressed
attention's lse given and computed by the kernel, several token tiles and several chunks of compressed
rows (the online lse across chunks), packed sequences with an empty one (eager and with a traced
cu_seqlens), queries at the end of a KV cache's ragged sequences (per batch row, over several tiles and
chunks, NaN rows past each sequence's complete blocks), ties (all-equal compressed keys), float32, bfloat16
and float16; its top-k walk alone on hostile ranks (ties within and across lanes and chunks, -inf). It is also exported for TPU (jax.export, platforms=["tpu"]) at the standard shape and an odd
one, which lowers it through Mosaic and so catches the layout and tiling errors that interpret mode lets
through; and its VMEM per step is checked against the default scoped limit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import nsa
from nsa._config import Shapes
from nsa._device import facts
from nsa._varlen import num_compressed_blocks, tokens
from nsa.pallas.tpu import select as pallas_select
from nsa.reference import select as reference

CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200)
INTERPRET = pltpu.InterpretParams(detect_races=True)


def _inputs(B, T, HQ, H, Dk, block_size, dtype, cu=None, seed=0):
    """q [B, T, HQ, Dk] and k_cmp [B, NC, H, Dk] in `dtype`, random normal."""
    rng = np.random.default_rng(seed)
    NC = num_compressed_blocks(T, block_size, cu)
    return (jnp.asarray(rng.standard_normal((B, T, HQ, Dk)), dtype),
            jnp.asarray(rng.standard_normal((B, NC, H, Dk)), dtype))


def _compressed_lse(q, k_cmp, block_size, cu, kv_lens=None):
    """Compressed attention's lse [B, T, HQ] of the float32 copies (the reference's)."""
    f32 = k_cmp.astype(jnp.float32)
    return nsa.compressed_attention(q.astype(jnp.float32), f32, f32, block_size=block_size, cu_seqlens=cu,
                                    kv_lens=kv_lens, implementation="xla")[1]


def _assert_equal(q, k_cmp, lse, block_counts, block_size, cu=None, config=None, kv_lens=None):
    """The kernel's ids equal the reference's on the float32 copies of the same rounded inputs (with the same
    lse), rank order too; returns them as NumPy."""
    kw = dict(block_counts=block_counts, block_size=block_size, scale=q.shape[-1] ** -0.5)
    got = pallas_select.forward(q, k_cmp, lse, cu, kv_lens, interpret=INTERPRET, config=config, **kw)
    ref = reference.forward(q.astype(jnp.float32), k_cmp.astype(jnp.float32), lse, cu, kv_lens, **kw)
    assert got.dtype == jnp.int32 and got.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    return np.asarray(got)


def _assert_forced_first(got, pos, block_size):
    """Every row starts with t // bs, then t // bs - 1 (when there are two slots and that block exists)."""
    cur = np.broadcast_to((pos // block_size)[None, :, None], got.shape[:3])
    np.testing.assert_array_equal(got[..., 0], cur)
    if got.shape[-1] > 1:
        np.testing.assert_array_equal(got[..., 1][cur >= 1], (cur - 1)[cur >= 1])


def _assert_well_formed(got, pos, block_size):
    """Each row: min(slots, pos // bs + 1) distinct blocks of [0, pos // bs], then -1."""
    for t, p in enumerate(pos):
        row = got[:, t].reshape(-1, got.shape[-1])
        used = min(got.shape[-1], p // block_size + 1)
        assert np.all(row[:, used:] == -1), t
        assert np.all((row[:, :used] >= 0) & (row[:, :used] <= p // block_size)), t
        assert all(len(set(r[:used])) == used for r in row), t


# (B, T, HQ, H, Dk, block_size), dtype, block_counts, lse given, config (None: the default)
CASES = {
    "G1-B2-T40-bs16": ((2, 40, 2, 2, 16, 16), "float32", (1, 3), False, None),
    "G3-dk24-more-than-blocks-lse": ((1, 50, 3, 1, 24, 8), "float32", (3, 9), True, None),
    # 150 compressed rows: two chunks of 128; 19 tiles of 16 tokens (T = 300 is not a multiple of 16)
    "G2-dk64-bs2-tiles-chunks": ((1, 300, 4, 2, 64, 2), "float32", (6,), False, pallas_select.Config(16, 128)),
    "G2-dk64-bs2-tiles-chunks-lse": ((1, 300, 4, 2, 64, 2), "float32", (6,), True, pallas_select.Config(16, 128)),
    "G1-bf16-dk200": ((1, 100, 4, 4, 200, 8), "bfloat16", (3, 20), False, None),
    "G3-bf16-lse": ((1, 70, 6, 2, 32, 4), "bfloat16", (5,), True, pallas_select.Config(32, 128)),
    "G2-fp16": ((1, 50, 4, 2, 32, 8), "float16", (4,), False, None),
}


@pytest.mark.parametrize("shape, dtype, counts, with_lse, config", CASES.values(), ids=CASES.keys())
def test_matches_the_reference_in_interpret_mode(shape, dtype, counts, with_lse, config, pallas_races):
    B, T, HQ, H, Dk, bs = shape
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, dtype)
    lse = _compressed_lse(q, k_cmp, bs, None) if with_lse else None
    for block_counts in counts:
        got = _assert_equal(q, k_cmp, lse, block_counts, bs, config=config)
        _assert_forced_first(got, np.arange(T), bs)
        _assert_well_formed(got, np.arange(T), bs)


def test_packed_sequences_with_an_empty_one(pallas_races):
    """G = 16 (one token tile of 128: tiles span several sequences), packed lengths 37, 0, 113, 50; lse
    computed by the kernel and given; under jit cu_seqlens is traced (more rows than the sequences use) and
    the result is the same. The ids are in-sequence: each row starts with pos // bs."""
    B, T, HQ, H, Dk, bs = 1, 200, 16, 1, 128, 32
    cu = jnp.asarray(CU)
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, "float32", CU)
    got = _assert_equal(q, k_cmp, None, 4, bs, cu)
    pos = np.asarray(tokens(T, bs, cu).pos[0])
    _assert_forced_first(got, pos, bs)
    _assert_well_formed(got, pos, bs)
    _assert_equal(q, k_cmp, _compressed_lse(q, k_cmp, bs, cu), 4, bs, cu)
    traced = jax.jit(lambda q, k, cu: pallas_select.forward(q, k, None, cu, block_counts=4, block_size=bs,
                                                            scale=Dk ** -0.5, interpret=INTERPRET))(q, k_cmp, cu)
    np.testing.assert_array_equal(np.asarray(traced), got)


def test_a_kv_cache(pallas_races):
    """The last 40 queries of sequences of 300 and 171 tokens (kv_lens) over 150 compressed rows (block 2):
    token rows and chunk bands per batch row, 3 token tiles of 16 and 2 chunks of 128 rows (the second
    sequence's tokens see only the first), block_counts past cdiv(T, bs) = 20 (a cached token has up to NC
    candidates), and NaN rows past each sequence's complete blocks (never read); lse computed by the
    kernel and given, as the reference's."""
    lens = jnp.asarray([300, 171], jnp.int32)
    q, k_cmp = _inputs(2, 300, 4, 2, 32, 2, "float32")
    q = q[:, :40]
    k_cmp = jnp.where(jnp.arange(150)[None, :, None, None] >= lens[:, None, None, None] // 2, jnp.nan, k_cmp)
    config = pallas_select.Config(16, 128)
    for lse, block_counts in ((None, 3), (_compressed_lse(q, k_cmp, 2, None, lens), 24)):
        _assert_equal(q, k_cmp, lse, block_counts, 2, config=config, kv_lens=lens)


def test_ties_go_to_lower_ids(pallas_races):
    """All-equal compressed keys: every visible block scores the same, so the lowest ids win, after the
    forced blocks (t // bs, t // bs - 1, 0); the slots past the candidates are -1."""
    B, T, HQ, H, Dk, bs = 1, 60, 4, 2, 16, 8
    q, _ = _inputs(B, T, HQ, H, Dk, bs, "float32")
    k_cmp = jnp.ones((B, num_compressed_blocks(T, bs), H, Dk), jnp.float32)
    got = _assert_equal(q, k_cmp, None, 9, bs)
    for t in range(T):
        cur = t // bs
        forced = list(dict.fromkeys(c for c in (cur, cur - 1, 0) if c >= 0))
        expected = (forced + [c for c in range(cur + 1) if c not in forced])[:9]
        expected += [-1] * (9 - len(expected))
        for h in range(H):
            assert list(got[0, t, h]) == expected, (t, h)


def test_top_k_on_hostile_ranks():
    """The top-k walk alone on ranks of few distinct values (ties within a lane across chunks, across lanes of a
    chunk, and across chunks), -inf rows, a band of chunks lo..hi that skips the first, and tokens with fewer
    candidates than slots: each token's slots are its ranks' order by (rank descending, row ascending), -1 once
    only -inf is left; chunks outside the band are never read."""
    rng = np.random.default_rng(3)
    chunks, tb, bc, slots, lo, hi = 4, 16, 128, 24, 1, 3
    ranks = rng.integers(0, 4, (chunks, tb, bc)).astype(np.float32)
    ranks[rng.random(ranks.shape) < 0.5] = -np.inf
    ranks[:, :4] = -np.inf  # tokens with no candidate at all
    ranks[:, 4:6, : bc - 3] = -np.inf  # tokens with three candidates per chunk, 9 in the band: fewer than slots
    ranks[0] = np.nan  # outside the band
    first = rng.integers(0, 5, (tb, 1)).astype(np.int32)

    def kernel(first_ref, ranks_ref, out_ref, rank_scr):
        rank_scr[...] = ranks_ref[...]
        out_ref[...] = pallas_select._top_k(rank_scr, lo, hi, first_ref[...], slots)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((tb, slots), jnp.int32),
                         scratch_shapes=[pltpu.VMEM((chunks, tb, bc), jnp.float32)],
                         interpret=INTERPRET)(jnp.asarray(first), jnp.asarray(ranks))
    for t in range(tb):
        rank = ranks[lo:hi + 1, t].reshape(-1)
        rows = lo * bc + np.arange(rank.size)
        order = [r for r in np.lexsort((rows, -rank)) if rank[r] > -np.inf][:slots]
        want = [rows[r] - first[t, 0] for r in order] + [-1] * (slots - len(order))
        assert list(np.asarray(got)[t]) == want, t


def test_rejects_a_bad_config():
    q, k_cmp = _inputs(1, 40, 2, 1, 16, 8, "bfloat16")
    kw = dict(block_counts=2, block_size=8, scale=0.25, interpret=INTERPRET)
    with pytest.raises(ValueError, match="config.tokens: expected a positive multiple of 16"):
        pallas_select.forward(q, k_cmp, None, None, config=pallas_select.Config(8, 128), **kw)
    with pytest.raises(ValueError, match="Config.chunk: expected a positive multiple of 128, got 64"):
        pallas_select.forward(q, k_cmp, None, None, config=pallas_select.Config(16, 64), **kw)


@pytest.mark.parametrize("shape, dtype, with_lse", [((1, 8192, 64, 4, 128), jnp.bfloat16, True),  # standard
                                                    ((1, 1000, 6, 2, 64), jnp.float32, False)],  # G = 3
                         ids=["standard-bf16-lse", "odd-f32"])
def test_lowers_for_tpu(shape, dtype, with_lse):
    """jax.export for TPU lowers the kernel through Mosaic: one tpu_custom_call (with or without lse)."""
    B, T, HQ, H, Dk = shape
    NC = -(-T // 64)
    args = [jax.ShapeDtypeStruct((B, T, HQ, Dk), dtype), jax.ShapeDtypeStruct((B, NC, H, Dk), dtype)]
    if with_lse:
        args.append(jax.ShapeDtypeStruct((B, T, HQ), jnp.float32))

    def select(q, k_cmp, lse=None):
        return pallas_select.forward(q, k_cmp, lse, None, block_counts=16, block_size=64, scale=Dk ** -0.5)

    module = jax.export.export(jax.jit(select), platforms=["tpu"])(*args).mlir_module()
    assert module.count("tpu_custom_call") == 1


@pytest.mark.parametrize("T, block_size", [(8192, 64), (262144, 16)], ids=["standard", "16k-rows"])
@pytest.mark.parametrize("dk, dtype", [(128, jnp.bfloat16), (256, jnp.float32), (16, jnp.float32)])
def test_vmem_budget(T, block_size, dk, dtype):
    """With default_config, every block double-buffered plus the scratch, up to the widest heads of the
    contract (256) in float32 at G = 16: within the 16 MiB of scoped VMEM that Mosaic gives a kernel by
    default (VMEM is 64 MiB per core on v5p, 128 MiB on v5e and v6e), also with 16k compressed rows."""
    q = jax.ShapeDtypeStruct((1, T, 64, dk), dtype)
    k_cmp = jax.ShapeDtypeStruct((1, T // block_size, 4, dk), dtype)
    shapes = Shapes.of(q, k_cmp, block_counts=16, block_size=block_size)  # TK: NC, every row a token may see
    config = pallas_select.default_config(shapes, dtype, facts("tpu"))
    used = pallas_select.vmem_bytes(16, dk, jnp.dtype(dtype).itemsize, T // block_size, 16, config)
    assert used <= pallas_select.vmem_budget(facts("tpu")) == 12 * 2 ** 20
    if T == 8192:
        assert config.tokens == 128  # the standard shape needs no smaller tile
