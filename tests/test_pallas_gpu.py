"""The shared test base on the Mosaic GPU kernels (implementation="pallas" on an NVIDIA GPU), and what only a
GPU can show of them.

Run on an NVIDIA Hopper GPU with jax >= 0.11: `scripts/gpu.sh tests` (pytest -m gpu). On the CPU `make test`
deselects it; there the kernels are exported for CUDA (tests/test_pallas_gpu_export.py,
tests/test_pallas_gpu_select.py), which runs Mosaic GPU's lowering but not the kernels.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from tests.base import TOLERANCE, NSATestBase, assert_close
from tests.test_triton_gpu import long_sequence_check

pytestmark = pytest.mark.gpu

KERNEL_OPS = ("compressed_attention", "select_blocks", "selected_attention", "sliding_window_attention")


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")


class TestPallasGPU(NSATestBase):
    implementation = "pallas"
    dtypes = ("bfloat16", "float16")
    exhaustive = True


def test_long_sequence_needs_64_bit_offsets():
    long_sequence_check("pallas")


def test_without_jax_triton_the_default_runs_the_mosaic_gpu_kernels(without_jax_triton):
    """With jax[cuda] alone, implementation=None runs the Mosaic GPU kernels on 16-bit inputs: no warning, the
    same bits as implementation="pallas"; float32 runs the reference, and says so once."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 300, 16, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 300, 1, 64)), jnp.bfloat16) for _ in range(2))
    run = lambda impl, *x: jax.jit(lambda q, k, v: nsa.attention(q, k, v, g_cmp=q[..., 0], block_counts=4,
                                                                 block_size=32, window_size=64,
                                                                 implementation=impl))(*x)
    assert {nsa.implementations()[op] for op in KERNEL_OPS} == {"pallas"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        o = run(None, q, k, v)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(run("pallas", q, k, v), np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(None, *(x.astype(jnp.float32) for x in (q, k, v)))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "Mosaic GPU kernels take bfloat16, float16" in messages[0], messages


def test_explicit_pallas_on_float32_raises():
    """The Mosaic GPU kernels take 16-bit inputs; an explicit implementation="pallas" on float32 raises when the
    program is compiled for the GPU, and never falls back."""
    q = jnp.zeros((1, 64, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="cannot run this op on a CUDA GPU: its Mosaic GPU kernels take bfloat16"):
        jax.block_until_ready(nsa.sliding_window_attention(q, q[:, :, :1], q[:, :, :1], window_size=8,
                                                           implementation="pallas"))


def test_compressed_gradients_split_over_programs():
    """The compressed branch's dk/dv with its key tiles' walks split over several programs (few compressed rows,
    many queries: nsa/pallas/gpu/_flash.py `_dkdv_parts`) equals the reference's, and repeats bitwise."""
    from nsa import _config, _device
    from nsa.pallas.gpu import _flash

    B, T, HQ, H, D, bs = 1, 1024, 16, 1, 64, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, HQ, D)), jnp.bfloat16)
    k_cmp, v_cmp = (jnp.asarray(rng.standard_normal((B, T // bs, H, D)), jnp.bfloat16) for _ in range(2))
    do = jnp.asarray(rng.standard_normal((B, T, HQ, D)), jnp.float32)
    device = _device.facts("cuda")
    config = _flash.default_config(_config.Shapes.of(q, k_cmp, v_cmp, block_size=bs), q.dtype, device)
    lay = _flash._Layout(q, k_cmp, v_cmp, jnp.zeros((T,), jnp.int32), jnp.zeros((T,), jnp.int32), config, device)
    assert _flash._dkdv_parts(lay, T) > 1

    def grads(impl, *x):
        loss = lambda q, k, v: jnp.sum(nsa.compressed_attention(q, k, v, block_size=bs, implementation=impl)[0]
                                       .astype(jnp.float32) * do)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*x)

    got, again = grads("pallas", q, k_cmp, v_cmp), grads("pallas", q, k_cmp, v_cmp)
    want = grads("xla", *(x.astype(jnp.float32) for x in (q, k_cmp, v_cmp)))
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, again):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
        assert_close(np.asarray(a, np.float32), np.asarray(b), TOLERANCE["bfloat16"] * 2, name)
