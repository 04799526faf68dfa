"""What only the XLA reference promises: float64 numerical gradients, the hand-written backward
against autodiff of the forward, compression, rank order, memory and the default dispatch on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import nsa
from nsa import reference
from tests import oracle
from tests.base import CU_SEQLENS, Inputs, assert_close, largest_intermediate

SMALL = (1, 21, 6, 2, 4, 3, 4)  # G = 3, Dv != Dk, T not a multiple of block_size


def _branches(x, cu_seqlens=None):
    """Each differentiable op as (f, args) on float64 inputs."""
    bs = x.block_size
    idx = x.block_indices(3)
    k_cmp, _, v_cmp, _ = x.compressed(cu_seqlens)
    g = [gi[0] for gi in x.gates]
    kw = dict(cu_seqlens=cu_seqlens, implementation="xla")
    return {
        "compress": (lambda k: nsa.compress(k, block_size=bs, cu_seqlens=cu_seqlens), (x.k,)),
        "compressed": (lambda q, kc, vc: nsa.compressed_attention(q, kc, vc, block_size=bs, **kw), (x.q, k_cmp, v_cmp)),
        "selected": (lambda q, k, v: nsa.selected_attention(q, k, v, idx, block_size=bs, **kw), (x.q, x.k, x.v)),
        "window": (lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=6, **kw), (x.q, x.k, x.v)),
        "attention": (lambda q, k, v, a, b, c: nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, block_counts=3,
                                                             block_size=bs, window_size=6, **kw), (x.q, x.k, x.v, *g)),
    }


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("name", ["compress", "compressed", "selected", "window", "attention"])
def test_check_grads_float64(name, varlen):
    with jax.enable_x64(True):
        shape = (1, 30, 6, 2, 4, 3, 4)
        cu = np.array([0, 9, 9, 30], np.int32) if varlen else None
        f, args = _branches(Inputs(shape if varlen else SMALL, "float64"), cu)[name]
        check_grads(f, args, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["compress", "compress-overlapping", "compressed", "compressed-overlapping",
                                  "selected", "window"])
def test_custom_backward_matches_autodiff_of_the_forward(name):
    """The hand-written backward of each op against jax.vjp of its own reference forward; -overlapping: windows of
    8 tokens every 2 (four rows hold each token)."""
    op = name.split("-")[0]
    with jax.enable_x64(True):
        x = Inputs((1, 37, 4, 2, 8, 5, 8), "float64")
        forward, backward = reference.OPS[op]
        bs = x.block_size
        k_cmp, _, v_cmp, _ = x.compressed()
        strided = [jnp.asarray(oracle.compress(y, block_size=bs, stride=2)) for y in (x.k64, x.v64)]
        counts = jnp.full((1, 37, 2), 3, jnp.int32)
        arrays, static = {
            "compress": ((x.k,), dict(block_size=bs, stride=bs, num_blocks=5)),
            "compress-overlapping": ((x.k,), dict(block_size=bs, stride=2, num_blocks=19)),
            "compressed": ((x.q, k_cmp, v_cmp), dict(block_size=bs, stride=bs, scale=0.3)),
            "compressed-overlapping": ((x.q, *strided), dict(block_size=bs, stride=2, scale=0.3)),
            "selected": ((x.q, x.k, x.v), dict(block_size=bs, scale=0.3)),
            "window": ((x.q, x.k, x.v), dict(window_size=7, scale=0.3)),
        }[name]
        extra = {"compress": (None,), "compressed": (None,), "window": (None,),
                 "selected": (jnp.asarray(x.block_indices(3)), counts, None)}[op]
        f = lambda *a: forward(*a, *extra, **static)[0]
        out, autodiff = jax.vjp(f, *arrays)
        ct = jax.tree_util.tree_map(lambda o: jnp.asarray(np.random.default_rng(3).standard_normal(o.shape)), out)
        if op == "compressed":  # the lse cotangent is only meaningful where lse is finite
            ct = (ct[0], jnp.where(jnp.isfinite(out[1]), ct[1], 0.0))
        _, residuals = forward(*arrays, *extra, **static)
        hand = backward(residuals, ct, **static)
        for a, b in zip(hand, autodiff(ct)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T, block_size", [(37, 8), (5, 8), (64, 16)])
def test_compress_against_the_oracle(T, block_size):
    x = np.random.default_rng(0).standard_normal((2, T, 3, 5)).astype(np.float32)
    got = nsa.compress(x, block_size=block_size)
    assert got.shape == (2, -(-T // block_size), 3, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), oracle.compress(x, block_size=block_size), rtol=1e-6, atol=1e-6)


def test_compress_packs_sequences_and_pads_to_a_bound_when_traced():
    x = np.random.default_rng(0).standard_normal((1, 100, 2, 4)).astype(np.float32)
    ref = oracle.compress(x, block_size=16, cu_seqlens=CU_SEQLENS)
    got = nsa.compress(x, block_size=16, cu_seqlens=CU_SEQLENS)
    assert got.shape == ref.shape == (1, 2 + 3 + 2, 2, 4)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-6)
    traced = jax.jit(lambda x, cu: nsa.compress(x, block_size=16, cu_seqlens=cu))(x, CU_SEQLENS)
    N = len(CU_SEQLENS) - 1
    assert traced.shape[1] == min(100, (100 + N * 15) // 16)
    np.testing.assert_allclose(np.asarray(traced[:, :7]), ref, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(traced[:, 7:]) == 0)


def test_compress_keeps_dtype_and_accumulates_in_float32():
    x = jnp.full((1, 64, 1, 2), 1.0 + 2 ** -7, jnp.bfloat16)  # sums of bf16 would round
    y = nsa.compress(x, block_size=64)
    assert y.dtype == jnp.bfloat16
    assert float(y[0, 0, 0, 0]) == pytest.approx(1.0 + 2 ** -7)


def test_select_rows_are_in_rank_order():
    x = Inputs((1, 90, 4, 2, 8, 8, 8), "float32")
    k_cmp, k_cmp64, _, _ = x.compressed()
    idx = nsa.select_blocks(x.q, k_cmp, block_counts=6, block_size=8, implementation="xla")
    np.testing.assert_array_equal(np.asarray(idx), oracle.select_blocks(x.q64, k_cmp64, block_counts=6, block_size=8))


def test_default_implementation_on_cpu_is_the_reference():
    x = Inputs((1, 50, 4, 2, 8, 8, 8), "float32")
    g = [gi[0] for gi in x.gates]
    run = lambda impl: nsa.attention(x.q, x.k, x.v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3,
                                     block_size=8, window_size=9, implementation=impl)
    np.testing.assert_array_equal(np.asarray(run(None)), np.asarray(run("xla")))


def test_standard_shape_never_builds_a_whole_sequence_score_matrix():
    """Forward + backward at T = 8192, HQ = 64, H = 4, D = 128 (traced, not run): no intermediate is
    anywhere near the [T, T, HQ] or [T, S * block_size, HQ] arrays of an unchunked implementation."""
    T, HQ, H, D = 8192, 64, 4, 128
    q = jax.ShapeDtypeStruct((1, T, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1, T, HQ), jnp.bfloat16)

    def loss(q, k, v, a, b, c):
        o = nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, block_counts=16, block_size=64, window_size=512,
                          implementation="xla")
        return jnp.sum(o.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(q, kv, kv, g, g, g)
    largest = largest_intermediate(jaxpr.jaxpr)
    whole_selection = T * 16 * 64 * HQ * 4  # [T, S * bs, HQ] float32: 2 GiB
    assert largest <= 512 * 2 ** 20 < whole_selection, f"largest intermediate {largest / 2 ** 20:.0f} MiB"
