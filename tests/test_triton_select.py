"""The Triton block-selection kernel (nsa/triton/select.py): what the shared test base does not check.

On the CPU (every test but the gpu-marked one) the kernel runs in Triton's interpreter
(nsa/triton/interpreter.py; the base runs there too, tests/test_triton_interpreted.py) and must return
exactly the XLA reference's block ids in the reference's rank order (the base compares sets with the
float64 oracle): G = 3 with Dk = 24, block_counts beyond the blocks, float16; compressed rows that no
query sees (NaN, never used) eager and with a traced cu_seqlens; compressed attention's lse given with
programs whose tokens span two packed sequences; queries at the end of a KV cache walking several chunks
of compressed rows. bfloat16 and wide heads run on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa._config import Shapes
from nsa._device import TABLE
from nsa._varlen import num_compressed_blocks, tokens
from nsa.api import _select as select_with_lse
from nsa.reference import select as reference
from nsa.triton import decode_select
from nsa.triton import select as triton_select
from tests.conftest import ON_GPU

pytestmark = pytest.mark.interpreted  # the kernels in Triton's interpreter (their gpu tests: pytest -m gpu)

CU = np.array([0, 23, 23, 41, 70], np.int32)  # lengths 23, 0, 18, 29 (T = 70)


def _inputs(B, T, HQ, H, Dk, block_size, dtype, cu=None, seed=0):
    """q [B, T, HQ, Dk] and k_cmp [B, NC, H, Dk] in `dtype`, random normal."""
    rng = np.random.default_rng(seed)
    NC = num_compressed_blocks(T, block_size, cu)
    q = jnp.asarray(rng.standard_normal((B, T, HQ, Dk)), dtype)
    k_cmp = jnp.asarray(rng.standard_normal((B, NC, H, Dk)), dtype)
    return q, k_cmp


def _select(impl, q, k_cmp, block_counts, block_size, cu=None):
    return nsa.select_blocks(q, k_cmp, block_counts=block_counts, block_size=block_size, cu_seqlens=cu,
                             implementation=impl)


def _assert_equal(q, k_cmp, block_counts, block_size, cu=None):
    """The kernel's ids equal the reference's (float32 copies of the same rounded inputs), rank order too."""
    got = _select("triton", q, k_cmp, block_counts, block_size, cu)
    ref = _select("xla", q.astype(jnp.float32), k_cmp.astype(jnp.float32), block_counts, block_size, cu)
    assert got.dtype == jnp.int32 and got.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    return np.asarray(got)


# (B, T, HQ, H, Dk, block_size), dtype, block_counts
CASES = {
    "G3-T50-dk24": ((1, 50, 3, 1, 24, 8), "float32", (2, 5)),
    "G2-more-than-blocks": ((1, 45, 4, 2, 16, 8), "float32", (9,)),
    "G3-fp16": ((1, 50, 3, 1, 32, 8), "float16", (1, 5)),
}


@pytest.mark.parametrize("shape, dtype, counts", CASES.values(), ids=CASES.keys())
def test_matches_reference_exactly(interpreted, shape, dtype, counts):
    B, T, HQ, H, Dk, bs = shape
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, dtype)
    for block_counts in counts:
        got = _assert_equal(q, k_cmp, block_counts, bs)
        # the forced blocks lead every row: t // bs, then t // bs - 1, then 0
        cur = np.arange(T) // bs
        np.testing.assert_array_equal(got[..., 0], np.broadcast_to(cur[None, :, None], got.shape[:3]))
        if block_counts > 1:
            np.testing.assert_array_equal(got[:, bs:, :, 1], np.broadcast_to((cur - 1)[None, bs:, None],
                                                                              got[:, bs:].shape[:3]))
        if T < bs:  # one block only: the rest of each row is unused
            assert np.all(got[..., 1:] == -1)


def test_varlen_with_an_empty_sequence_eager_and_traced(interpreted):
    """Packed sequences (one empty); k_cmp rows that no query sees (each sequence's partial last block)
    are NaN and must never be used; under jit cu_seqlens is traced and the result is the same."""
    B, T, HQ, H, Dk, bs = 1, 70, 6, 2, 16, 8
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, "float32", CU)
    lengths = np.diff(CU)
    first_row = np.cumsum(-(-lengths // bs)) - (-(-lengths // bs))
    never_seen = [f + n // bs for f, n in zip(first_row, lengths) if n % bs]
    k_nan = k_cmp.at[:, never_seen].set(jnp.nan)
    k_zero = k_cmp.at[:, never_seen].set(0.0)
    cu = jnp.asarray(CU)
    got = _select("triton", q, k_nan, 4, bs, cu)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_select("xla", q, k_zero, 4, bs, cu)))
    traced = jax.jit(lambda q, k, cu: _select("triton", q, k, 4, bs, cu))(q, k_nan, cu)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(got))
    pos = np.asarray(tokens(T, bs, cu).pos[0])
    assert np.all(np.asarray(got)[0, :, :, 0] == (pos // bs)[:, None])  # in-sequence ids


def test_given_lse_packed_tiles_across_sequences(interpreted):
    """With compressed attention's lse the kernel skips its own pass and still returns the reference's
    ids (the reference computing its own lse): G = 5 (heads padded to 8, 4 tokens per program), packed
    sequences with programs whose tokens belong to two sequences, queries that see no compressed row
    (lse = -inf)."""
    B, T, HQ, H, Dk, bs = 1, 70, 10, 2, 16, 4
    cu = jnp.asarray(CU)
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, "float32", CU, seed=1)
    shapes = Shapes.of(q, k_cmp, block_size=bs, block_counts=5, packed=True)
    tb = triton_select.default_config(shapes, q.dtype, H200).tokens
    assert tb > 1 and any(c % tb for c in CU[1:-1]), "no program spans two sequences"  # tokens c - 1 and c
    lse = nsa.compressed_attention(q, k_cmp, k_cmp, block_size=bs, cu_seqlens=cu, implementation="xla")[1]
    assert np.any(np.isneginf(np.asarray(lse)))
    got = select_with_lse(q, k_cmp, lse, 5, bs, (bs, bs), None, cu, None, "triton")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_select("xla", q, k_cmp, 5, bs, cu)))


@pytest.mark.parametrize("HQ, tq", [(16, 1), (3, 13)], ids=["G16-decode", "G3-chunk"])
def test_cached_queries_over_several_chunks(interpreted, HQ, tq):
    """The last tq tokens of sequences of 100 and 61 tokens in a KV cache, whose k_cmp (25 rows of 4 tokens:
    NB = 25 candidate blocks) is NaN past each sequence's complete blocks (never read), walked in chunks of 16
    rows (a Config), one token per program (G = 16) or 8 (G = 3, the last tile partial), with and without
    compressed attention's lse: exactly the reference's ids (on zeros past each sequence)."""
    B, TK, H, Dk, bs = 2, 100, 1, 16, 4
    lens = np.array([100, 61], np.int32)
    q, _ = _inputs(B, tq, HQ, H, Dk, bs, "float32")
    _, k_cmp = _inputs(B, TK, HQ, H, Dk, bs, "float32")
    past = np.arange(TK // bs)[None, :, None, None] >= (lens // bs)[:, None, None, None]
    k_zero, kv_lens = jnp.where(past, 0.0, k_cmp), jnp.asarray(lens)
    shapes = Shapes.of(q, k_cmp, block_size=bs, block_counts=5)
    config = triton_select.default_config(shapes, q.dtype, H200)._replace(chunk=16)
    lse = nsa.compressed_attention(q, k_zero, k_zero, block_size=bs, kv_lens=kv_lens, implementation="xla")[1]
    ref = nsa.select_blocks(q, k_zero, block_counts=5, block_size=bs, kv_lens=kv_lens, implementation="xla")
    for given in (None, lse):
        got = triton_select.forward(q, jnp.where(past, jnp.nan, k_cmp), given, None, kv_lens, block_counts=5,
                                    block_size=bs, scale=Dk ** -0.5, config=config, decode=False)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


H200 = TABLE["NVIDIA H200"]
DECODE_CONFIGS = {"3-splits": decode_select.Config(chunk=16, splits=3, num_warps=4, num_stages=2),
                  "1-split": decode_select.Config(chunk=16, splits=1, num_warps=4, num_stages=1),
                  "64-splits": decode_select.Config(chunk=16, splits=64, num_warps=4, num_stages=1),
                  "default": None}


@pytest.mark.parametrize("config", DECODE_CONFIGS.values(), ids=DECODE_CONFIGS.keys())
@pytest.mark.parametrize("HQ, tq", [(16, 1), (3, 5)], ids=["G16-decode", "G3-5-tokens"])
def test_decode_kernel_matches_reference_exactly(interpreted, HQ, tq, config):
    """The decode select (nsa/triton/decode_select.py, forward(decode=True): a few queries at the end of a cache,
    the candidate blocks split over programs and merged) returns exactly the reference's ids in rank order: the
    last tq tokens of sequences of 200 and 61 tokens in a cache of 50 compressed rows (block 4), NaN past each
    sequence's complete blocks (never read), walked in chunks of 16 rows split over 3 programs (one without
    rows), 64 (most without: the merge takes 64 tops) or one, or the default config, with and without
    compressed attention's lse; two rows of k_cmp in different splits are equal, so their blocks tie and the
    lower id must come first."""
    B, TK, H, Dk, bs = 2, 200, 1, 16, 4
    lens = np.array([200, 61], np.int32)
    q, _ = _inputs(B, tq, HQ, H, Dk, bs, "float32", seed=2)
    _, k_cmp = _inputs(B, TK, HQ, H, Dk, bs, "float32", seed=3)
    favourite = jnp.sum(q, axis=(1, 2))[:, None]  # [B, 1, Dk]: a key every query likes
    k_cmp = k_cmp.at[:, 3].set(favourite).at[:, 40].set(favourite)  # a tie that wins
    past = np.arange(TK // bs)[None, :, None, None] >= (lens // bs)[:, None, None, None]
    k_zero, kv_lens = jnp.where(past, 0.0, k_cmp), jnp.asarray(lens)
    lse = nsa.compressed_attention(q, k_zero, k_zero, block_size=bs, kv_lens=kv_lens, implementation="xla")[1]
    ref = np.asarray(nsa.select_blocks(q, k_zero, block_counts=5, block_size=bs, kv_lens=kv_lens,
                                       implementation="xla"))
    assert np.any(np.all(np.isin([3, 40], ref[0]), -1)), "the tied blocks are not both selected"
    for given in (None, lse):
        got = triton_select.forward(q, jnp.where(past, jnp.nan, k_cmp), given, None, kv_lens, block_counts=5,
                                    block_size=bs, scale=Dk ** -0.5, config=config, decode=True)
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_claims_select_where_blocks_sum_eq9():
    """The Triton family's claim on block selection (nsa.triton.CLAIMS) holds, statically, exactly where a selection
    block scores several compressed rows: compression windows that are not the blocks themselves."""
    import nsa.triton

    claim = nsa.triton.CLAIMS[("select", 0)]
    assert nsa.triton.claims("select", 0, "cuda") is claim and nsa.triton.claims("select", 0, "tpu") is None
    q, k_cmp = jnp.zeros((1, 256, 4, 16)), jnp.zeros((1, 16, 1, 16))
    holds = lambda **blocks: claim.test(q, k_cmp, None, None, block_counts=4, scale=0.25, **blocks)
    assert holds(block_size=64) is False
    assert holds(block_size=64, compress_block_size=64, compress_stride=64) is False
    assert holds(block_size=64, compress_block_size=32, compress_stride=16) is True
    assert holds(block_size=64, compress_block_size=64, compress_stride=32) is True


def test_default_decode_config():
    """Splits for four programs per SM (528 on an H200, 456 on an H100 PCIe), never more than the chunks of
    blocks (NC + 1 candidates) nor MAX_SPLITS (64): at B = 1 every chunk its own program up to 64, at B = 64
    three splits (two on the H100 PCIe), at B * H >= 528 one (no merge)."""
    shape = lambda B, T, heads: jax.ShapeDtypeStruct((B, T, heads, 128), jnp.bfloat16)
    config = lambda B, NC, device: decode_select.default_config(
        Shapes.of(shape(B, 1, 64), shape(B, NC, 4), block_size=64, block_counts=16), jnp.bfloat16, TABLE[device])
    for NC, splits in ((1024, 17), (8192, 64), (3, 1)):
        cfg = config(1, NC, "NVIDIA H200")
        assert (cfg.chunk, cfg.splits) == (min(64, max(16, 1 << (NC - 1).bit_length())), splits)
    for B, splits, device in ((64, 3, "NVIDIA H200"), (132, 1, "NVIDIA H200"), (64, 2, "NVIDIA H100 PCIe")):
        assert config(B, 1024, device).splits == splits


# ---------------------------------------------------------------------------------------- GPU

def _scores(q, k_cmp, block_size, scale):
    """Reference ranks [B, T, H, NB] of every block (float64 scores, forced ranks, -inf after t // bs)."""
    q, k_cmp = np.asarray(q, np.float64), np.asarray(k_cmp, np.float64)
    B, T, HQ, _ = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    s = scale * np.einsum("bthgd,bchd->bthgc", q.reshape(B, T, H, HQ // H, -1), k_cmp)
    visible = np.arange(NC)[None, :] < ((np.arange(T) + 1) // block_size)[:, None]  # [T, NC]
    s = np.where(visible[None, :, None, None], s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.where(visible[None, :, None, None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = e / np.maximum(np.sum(e, -1, keepdims=True), 1e-300)
    with jax.enable_x64(True):
        return np.asarray(reference.block_ranks(jnp.asarray(p.mean(3)), jnp.arange(T)[None], block_size=block_size))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, block_counts", [((1, 300, 6, 1, 256, 64), 16), ((2, 700, 16, 2, 192, 16), 64),
                                                 ((1, 1000, 3, 1, 16, 128), 5), ((1, 513, 4, 4, 64, 32), 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_select_wide_on_gpu(shape, block_counts, dtype):
    """Dk up to 256, block_size 16..128, block_counts up to 64, G in {1, 3, 6, 8}, every dtype.

    Against the reference in float32 exactly where it is unambiguous, and up to near-ties (equal
    float64 ranks within 1e-5) everywhere: the half-precision products sum in another order."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU and jax-triton")
    B, T, HQ, H, Dk, bs = shape
    q, k_cmp = _inputs(B, T, HQ, H, Dk, bs, dtype)
    got = np.asarray(_select("triton", q, k_cmp, block_counts, bs))
    ranks = _scores(q.astype(jnp.float32), k_cmp.astype(jnp.float32), bs, Dk ** -0.5)
    ref = np.asarray(_select("xla", q.astype(jnp.float32), k_cmp.astype(jnp.float32), block_counts, bs))
    assert got.shape == ref.shape and got.dtype == np.int32
    np.testing.assert_array_equal(got == -1, ref == -1)
    take = lambda idx: np.sort(np.where(idx >= 0, np.take_along_axis(ranks, np.maximum(idx, 0), -1), -1), -1)
    np.testing.assert_allclose(take(got), take(ref), rtol=1e-5, atol=1e-7)
    mismatch = np.mean(np.any(np.sort(got, -1) != np.sort(ref, -1), -1))
    assert mismatch < 0.01, f"{mismatch:.3%} of the rows select other blocks"
