"""The Triton flash kernels of the sliding-window and compressed branches (nsa/triton/_flash.py): what
the shared test base does not reach, in Triton's interpreter on the CPU (the base itself runs there in
tests/test_triton_interpreted.py, and on the GPU in tests/test_triton_gpu.py): compressed keys with rows
no query sees (each sequence's last, partial block), dk / dv summed over several splits of the queries, as
on the GPU at long T, and queries at the end of a KV cache across several query and key tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa._config import Shapes
from nsa._device import TABLE
from nsa._varlen import num_compressed_blocks
from tests.base import GRAD_TOLERANCE, TOLERANCE, assert_close, gradient_scales

pytestmark = pytest.mark.interpreted  # the kernels in Triton's interpreter (their gpu tests: pytest -m gpu)

CU = np.array([0, 23, 23, 41, 70], np.int32)  # lengths 23, 0, 18, 29 (T = 70)


def _inputs(B, T, HQ, H, Dk, Dv, NK, dtype, seed=0):
    """q, k, v (k/v with NK rows), do in `dtype` and their float32 copies."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in [(B, T, HQ, Dk), (B, NK, H, Dk), (B, NK, H, Dv), (B, T, HQ, Dv)]]
    low = [jnp.asarray(a, dtype) for a in arrays]
    return low, [x.astype(jnp.float32) for x in low]


def _compressed(impl, block_size, cu):
    return lambda q, k, v: nsa.compressed_attention(q, k, v, block_size=block_size, cu_seqlens=cu,
                                                    implementation=impl)


def _kernel_sizes(op, static):
    """A branch's sizes as its Triton module takes them: the compressed branch's windows every block_size."""
    return dict(static, stride=static["block_size"]) if op == "compressed" else static


def _check(make, low, ref_inputs, dtype):
    """Forward outputs and all gradients (do on o, a cos pattern on the finite lse) against XLA."""
    q, k, v, do = low
    (o, lse), vjp = jax.vjp(make("triton"), q, k, v)
    (o_ref, lse_ref), vjp_ref = jax.vjp(make("xla"), *ref_inputs[:3])
    assert lse.dtype == jnp.float32 and lse.shape == lse_ref.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    seen = np.isfinite(lse_ref)
    assert_close(np.asarray(lse)[seen], np.asarray(lse_ref)[seen], TOLERANCE[dtype], "lse")
    dlse = jnp.where(seen, jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape), 0.0)
    grads, grads_ref = vjp((do, dlse)), vjp_ref((ref_inputs[3], dlse))
    assert o.dtype == q.dtype
    assert_close(o, o_ref, TOLERANCE[dtype], "o")
    scales = gradient_scales(*ref_inputs, q.shape[-1] ** -0.5)
    for name, g, g_ref, x, size in zip(["dq", "dk", "dv"], grads, grads_ref, (q, k, v), scales):
        assert g.dtype == x.dtype, name
        assert_close(g, g_ref, GRAD_TOLERANCE[dtype], name, size)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter tests run on the CPU")
class TestTritonFlashInterpreted:

    @pytest.fixture(autouse=True)
    def _interpreted(self, interpreted):
        pass

    # (B, T, HQ, H, Dk, Dv), block_size, cu_seqlens, dtype: no length is a multiple of block_size
    @pytest.mark.parametrize("shape, block_size, cu, dtype", [
        pytest.param((2, 45, 2, 2, 16, 32), 8, None, "float32", id="G1-bs8"),
        pytest.param((1, 70, 4, 2, 16, 16), 8, CU, "float32", id="G2-varlen"),
        pytest.param((1, 70, 3, 1, 32, 16), 4, None, "float16", id="G3-bs4-fp16"),
    ])
    def test_compressed_with_rows_no_query_sees(self, shape, block_size, cu, dtype):
        """k_cmp whose last row of each sequence (a partial block) no query sees, and queries before their
        first complete block that see no row."""
        B, T, HQ, H, Dk, Dv = shape
        low, f32 = _inputs(B, T, HQ, H, Dk, Dv, num_compressed_blocks(T, block_size, cu), dtype)
        _check(lambda impl: _compressed(impl, block_size, cu), low, f32, dtype)
        if cu is None:
            (o, lse), vjp = jax.vjp(_compressed("triton", block_size, cu), *low[:3])
            assert not np.any(np.asarray(o[:, :block_size - 1]))
            assert np.all(np.isneginf(np.asarray(lse[:, :block_size - 1])))
            dq, dk_cmp, dv_cmp = vjp((low[3], jnp.ones_like(lse)))
            assert not np.any(np.asarray(dq[:, :block_size - 1]))
            assert not np.any(np.asarray(dk_cmp[:, -1])) and not np.any(np.asarray(dv_cmp[:, -1]))

    @pytest.mark.parametrize("cu", [None, CU], ids=["batched", "varlen"])
    @pytest.mark.parametrize("op", ["compressed", "window"])
    def test_dkdv_over_split_queries(self, cu, op):
        """dk / dv summed over several splits of the queries (as on the GPU at long T) and of the G = 3 query heads
        (as the window's at short T) still match: the backward entry point with a Config of 3 x 3 splits, against
        the reference's gradients."""
        from nsa.triton import _flash, compressed, window

        module, static, NK = {"compressed": (compressed, dict(block_size=4), num_compressed_blocks(70, 4, cu)),
                              "window": (window, dict(window_size=30), 70)}[op]
        (q, k, v, do), _ = _inputs(1, 70, 3, 1, 16, 16, NK, "float32")
        cu_j = None if cu is None else jnp.asarray(cu)
        # 16-query tiles in 3 splits of 32 queries (splits are whole tiles)
        shapes = Shapes.of(q, k, v, **static)
        config = _flash.default_config(shapes, q.dtype, TABLE["NVIDIA H200"])._replace(
            bwd_block_m=16, splits=3, head_splits=3)
        kernel = _kernel_sizes(op, static)
        out, res = module.forward(q, k, v, cu_j, scale=0.25, **kernel)
        dlse = jnp.where(jnp.isfinite(out[1]), 1.0, 0.0) if op == "compressed" else None
        grads = module.backward(res, do if dlse is None else (do, dlse), scale=0.25, config=config, **kernel)[:3]
        public = nsa.compressed_attention if op == "compressed" else nsa.sliding_window_attention
        _, vjp = jax.vjp(lambda q, k, v: public(q, k, v, scale=0.25, cu_seqlens=cu_j, implementation="xla",
                                                **static), q, k, v)
        expected = vjp(do if dlse is None else (do, dlse))
        for name, g, g_ref, size in zip(["dq", "dk", "dv"], grads, expected, gradient_scales(q, k, v, do, 0.25)):
            assert_close(g, g_ref, GRAD_TOLERANCE["float32"], name, size)

    @pytest.mark.parametrize("op", ["compressed", "window"])
    def test_cached_queries_over_tiles_and_splits(self, op):
        """Queries at the end of a KV cache in 16 x 16 tiles: the last 45 tokens (three query tiles, the last
        partial) of sequences of 100 and 61 tokens in a cache of 100 (keys past each length NaN: never read),
        whose key ranges span several key tiles, with dk / dv summed over 3 splits of the queries and 3 of the
        heads; against the reference on zeros past each length, and zero gradients there."""
        from nsa.triton import _flash, compressed, window

        bs, TQ, TK, lens = 4, 45, 100, np.array([100, 61], np.int32)
        module, static, public, NK, used = {
            "compressed": (compressed, dict(block_size=bs), nsa.compressed_attention, TK // bs, lens // bs),
            "window": (window, dict(window_size=30), nsa.sliding_window_attention, TK, lens)}[op]
        (q, k, v, do), _ = _inputs(2, TQ, 3, 1, 16, 16, NK, "float32")
        past = np.arange(NK)[None, :, None, None] >= used[:, None, None, None]
        kv_lens = jnp.asarray(lens)
        config = _flash.default_config(Shapes.of(q, k, v, **static), q.dtype, TABLE["NVIDIA H200"])._replace(
            block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=16, splits=3, head_splits=3)
        kernel = _kernel_sizes(op, static)
        out, res = module.forward(q, *(jnp.where(past, jnp.nan, x) for x in (k, v)), None, kv_lens, scale=0.25,
                                  config=config, **kernel)
        cotangent = (do, jnp.where(jnp.isfinite(out[1]), 1.0, 0.0)) if op == "compressed" else do
        grads = module.backward(res, cotangent, scale=0.25, config=config, **kernel)[:3]
        zero_k, zero_v = (jnp.where(past, 0.0, x) for x in (k, v))
        out_ref, vjp = jax.vjp(lambda q, k, v: public(q, k, v, scale=0.25, kv_lens=kv_lens, implementation="xla",
                                                      **static), q, zero_k, zero_v)
        for name, y, y_ref in zip(["o", "lse"], jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(out_ref)):
            seen = np.isfinite(np.asarray(y_ref))
            np.testing.assert_array_equal(np.isfinite(np.asarray(y)), seen)
            assert_close(np.asarray(y)[seen], np.asarray(y_ref)[seen], TOLERANCE["float32"], name)
        sizes = gradient_scales(q, zero_k, zero_v, do, 0.25)
        for name, g, g_ref, size in zip(["dq", "dk", "dv"], grads, vjp(cotangent), sizes):
            assert_close(g, g_ref, GRAD_TOLERANCE["float32"], name, size)
        for g in grads[1:]:
            assert not np.any(np.asarray(g)[np.broadcast_to(past, g.shape)])


def test_window_dkdv_splits_heads_where_key_tiles_are_few():
    """The window's dk/dv splits a KV head's 16 query heads over programs where the key tiles alone do not fill
    the GPU (a key row is seen by at most window_size queries: splitting the queries would leave programs idle),
    the compressed branch's splits its queries; the largest divisor of G that the GPU wants."""
    from nsa.triton import _flash

    h200 = TABLE["NVIDIA H200"]
    shapes = lambda T, **sizes: Shapes(B=1, T=T, TK=T if "window_size" in sizes else T // 64, HQ=64, H=4, Dk=128,
                                       Dv=128, **sizes)
    window = [_flash.default_config(shapes(T, window_size=512), jnp.bfloat16, h200) for T in (8192, 16384, 65536)]
    assert [(c.splits, c.head_splits) for c in window] == [(1, 4), (1, 2), (1, 1)]
    compressed = _flash.default_config(shapes(8192, block_size=64), jnp.bfloat16, h200)
    assert compressed.head_splits == 1 and compressed.splits > 1
    three = _flash.default_config(shapes(8192, window_size=512)._replace(HQ=12), jnp.bfloat16, h200)
    assert three.head_splits == 3  # G = 3: 3 divides it, 4 does not

