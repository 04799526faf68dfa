"""The Triton flash kernels of the sliding-window and compressed branches (nsa/triton/_flash.py).

TestTritonFlashInterpreted runs the kernels on the CPU in Triton's interpreter against the XLA
reference on small shapes (forward, lse, gradients with a cotangent on lse, G in {1, 3, 16}, Dv != Dk,
ragged T, packed sequences with an empty one, rows that see nothing, float32 and float16,
determinism). On the GPU the shared base runs them (tests/test_triton_gpu.py, `pytest -m gpu`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa._varlen import num_compressed_blocks
from tests.base import assert_close, gradient_scales

# Relative RMS error against the float32 XLA reference on the same rounded inputs.
TOL = {"float32": 1e-5, "float16": 2e-3}
CU = np.array([0, 23, 23, 41, 70], np.int32)  # lengths 23, 0, 18, 29 (T = 70)


def _inputs(B, T, HQ, H, Dk, Dv, NK, dtype, seed=0):
    """q, k, v (k/v with NK rows), do in `dtype` and their float32 copies."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in [(B, T, HQ, Dk), (B, NK, H, Dk), (B, NK, H, Dv), (B, T, HQ, Dv)]]
    low = [jnp.asarray(a, dtype) for a in arrays]
    return low, [x.astype(jnp.float32) for x in low]


def _assert_close(x, ref, dtype, what, scale=0.0):
    assert_close(x, ref, TOL[dtype], what, scale)


def _window(impl, window_size, cu):
    return lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=window_size, cu_seqlens=cu,
                                                        implementation=impl)


def _compressed(impl, block_size, cu):
    return lambda q, k, v: nsa.compressed_attention(q, k, v, block_size=block_size, cu_seqlens=cu,
                                                    implementation=impl)


def _check(make, low, ref_inputs, dtype, with_lse):
    """Forward outputs and all gradients (do on o, a cos pattern on the finite lse) against XLA."""
    q, k, v, do = low
    out, vjp = jax.vjp(make("triton"), q, k, v)
    ref, vjp_ref = jax.vjp(make("xla"), *ref_inputs[:3])
    if with_lse:
        (o, lse), (o_ref, lse_ref) = out, ref
        assert lse.dtype == jnp.float32 and lse.shape == lse_ref.shape
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        seen = np.isfinite(lse_ref)
        _assert_close(np.asarray(lse)[seen], np.asarray(lse_ref)[seen], dtype, "lse")
        dlse = jnp.where(seen, jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape), 0.0)
        grads, grads_ref = vjp((do, dlse)), vjp_ref((ref_inputs[3], dlse))
    else:
        o, o_ref = out, ref
        grads, grads_ref = vjp(do), vjp_ref(ref_inputs[3])
    assert o.dtype == q.dtype
    _assert_close(o, o_ref, dtype, "o")
    # with a window of 1, dq and dk are zero: measured against their natural size, not their roundoff
    scales = gradient_scales(*ref_inputs, q.shape[-1] ** -0.5)
    for name, g, g_ref, x, size in zip(["dq", "dk", "dv"], grads, grads_ref, (q, k, v), scales):
        assert g.dtype == x.dtype, name
        _assert_close(g, g_ref, dtype, name, size)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter tests run on the CPU")
class TestTritonFlashInterpreted:

    @pytest.fixture(autouse=True)
    def _interpreted(self, interpreted):
        pass

    # (B, T, HQ, H, Dk, Dv), window_size, cu_seqlens, dtype
    @pytest.mark.parametrize("shape, window_size, cu, dtype", [
        pytest.param((2, 37, 2, 2, 16, 32), 7, None, "float32", id="G1-w7"),
        pytest.param((1, 45, 3, 1, 32, 16), 1, None, "float32", id="G3-w1"),
        pytest.param((1, 20, 16, 1, 16, 24), 1000, None, "float32", id="G16-w>=T"),
        pytest.param((1, 70, 4, 2, 16, 16), 13, CU, "float32", id="G2-varlen"),
        pytest.param((1, 45, 3, 1, 32, 16), 7, None, "float16", id="G3-w7-fp16"),
    ])
    def test_window(self, shape, window_size, cu, dtype):
        B, T, HQ, H, Dk, Dv = shape
        low, f32 = _inputs(B, T, HQ, H, Dk, Dv, T, dtype)
        _check(lambda impl: _window(impl, window_size, cu), low, f32, dtype, with_lse=False)

    def test_window_zero_sees_nothing(self):
        (q, k, v, do), _ = _inputs(1, 20, 2, 1, 16, 16, 20, "float32")
        o, vjp = jax.vjp(_window("triton", 0, None), q, k, v)
        assert not np.any(np.asarray(o))
        assert all(not np.any(np.asarray(g)) for g in vjp(do))

    # (B, T, HQ, H, Dk, Dv), block_size, extra trailing rows of k_cmp, cu_seqlens, dtype
    @pytest.mark.parametrize("shape, block_size, extra, cu, dtype", [
        pytest.param((2, 45, 2, 2, 16, 32), 8, 2, None, "float32", id="G1-bs8"),
        pytest.param((1, 70, 3, 1, 32, 16), 4, 0, None, "float32", id="G3-bs4"),
        pytest.param((1, 40, 16, 1, 16, 16), 8, 1, None, "float32", id="G16-bs8"),
        pytest.param((1, 70, 4, 2, 16, 16), 8, 3, CU, "float32", id="G2-varlen"),
        pytest.param((1, 12, 2, 1, 16, 16), 16, 1, None, "float32", id="T<bs-nothing-seen"),
        pytest.param((1, 70, 3, 1, 32, 16), 4, 1, None, "float16", id="G3-bs4-fp16"),
    ])
    def test_compressed(self, shape, block_size, extra, cu, dtype):
        B, T, HQ, H, Dk, Dv = shape
        NC = num_compressed_blocks(T, block_size, cu) + extra
        low, f32 = _inputs(B, T, HQ, H, Dk, Dv, NC, dtype)
        _check(lambda impl: _compressed(impl, block_size, cu), low, f32, dtype, with_lse=True)
        if cu is None:  # queries before their first complete block see nothing
            (o, lse), vjp = jax.vjp(_compressed("triton", block_size, cu), *low[:3])
            assert not np.any(np.asarray(o[:, :block_size - 1]))
            assert np.all(np.isneginf(np.asarray(lse[:, :block_size - 1])))
            dq = vjp((low[3], jnp.ones_like(lse)))[0]
            assert not np.any(np.asarray(dq[:, :block_size - 1]))

    @pytest.mark.parametrize("cu", [None, CU], ids=["batched", "varlen"])
    @pytest.mark.parametrize("op", ["compressed", "window"])
    def test_dkdv_over_split_queries(self, cu, op):
        """dk / dv summed over several splits of the queries (as on the GPU at long T) still match: the
        backward entry point with a Config of 3 splits, against the reference's gradients."""
        from nsa.triton import _flash, compressed, window

        module, static, NK = {"compressed": (compressed, dict(block_size=4), num_compressed_blocks(70, 4, cu)),
                              "window": (window, dict(window_size=30), 70)}[op]
        (q, k, v, do), _ = _inputs(1, 70, 3, 1, 16, 16, NK, "float32")
        cu_j = None if cu is None else jnp.asarray(cu)
        # 16-query tiles in 3 splits of 32 queries (splits are whole tiles)
        config = _flash.default_config(q, k, v, backward=True, query_span=70)._replace(block_m=16, splits=3)
        out, res = module.forward(q, k, v, cu_j, scale=0.25, **static)
        dlse = jnp.where(jnp.isfinite(out[1]), 1.0, 0.0) if op == "compressed" else None
        grads = module.backward(res, do if dlse is None else (do, dlse), scale=0.25, config=config, **static)[:3]
        public = nsa.compressed_attention if op == "compressed" else nsa.sliding_window_attention
        _, vjp = jax.vjp(lambda q, k, v: public(q, k, v, scale=0.25, cu_seqlens=cu_j, implementation="xla",
                                                **static), q, k, v)
        expected = vjp(do if dlse is None else (do, dlse))
        for name, g, g_ref, size in zip(["dq", "dk", "dv"], grads, expected, gradient_scales(q, k, v, do, 0.25)):
            _assert_close(g, g_ref, "float32", name, size)

    def test_gradients_inside_shard_map(self):
        """Kernel outputs vary along the mesh axis like their inputs, so custom_vjp takes the gradients."""
        (q, k, v, do), _ = _inputs(2, 20, 2, 1, 16, 16, 20, "float32")
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("b",))
        spec = jax.sharding.PartitionSpec("b")
        loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * do)
        sharded = jax.shard_map(_window("triton", 5, None), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
        expected = jax.grad(loss(_window("xla", 5, None)), argnums=(0, 1, 2))(q, k, v)
        scales = gradient_scales(q, k, v, do, q.shape[-1] ** -0.5)
        for name, g, g_ref, size in zip(["dq", "dk", "dv"], grads, expected, scales):
            _assert_close(g, g_ref, "float32", name, size)

    def test_deterministic_under_jit(self):
        (q, k, v, do), _ = _inputs(1, 40, 3, 1, 16, 16, 40, "float32")
        k_cmp, v_cmp = k[:, :10], v[:, :10]

        def loss(q, k, v, k_cmp, v_cmp):
            o_w = _window("triton", 9, np.array([0, 23, 40], np.int32))(q, k, v)
            o_c, lse = _compressed("triton", 4, None)(q, k_cmp, v_cmp)
            return jnp.sum((o_w + o_c) * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        for a, b in zip(grad(q, k, v, k_cmp, v_cmp), grad(q, k, v, k_cmp, v_cmp)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
