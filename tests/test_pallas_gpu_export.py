"""The Mosaic GPU kernels (nsa/pallas/gpu) on the CPU: every op lowered for CUDA, and the dispatch around them.

No GPU here, and GPU interpret mode cannot run wgmma, so the kernels are exported for CUDA (jax.export,
platforms=["cuda"]): that runs Mosaic GPU's whole lowering (layout inference, TMA checks) and must give its
custom calls, and no Triton one. Their results are checked on the H200 by tests/test_pallas_gpu.py (the shared
test base). Mosaic GPU lowers these kernels from jax 0.11 on: the CI's Python 3.11 run (jax 0.10.2) checks only
that the dispatch then leaves them out.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa import _dispatch, _families, pallas
from tests.base import MOSAIC_GPU_LOWERS

needs_mosaic_gpu = pytest.mark.skipif(not MOSAIC_GPU_LOWERS, reason=f"jax {jax.__version__}: Mosaic GPU lowers these "
                                                                   "kernels from jax 0.11 on")
KERNEL_OPS = ("compressed_attention", "select_blocks", "selected_attention", "sliding_window_attention")


def _inputs(B, T, HQ, H, Dk, Dv, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((B, T, HQ, Dk)), dtype),
            jnp.asarray(rng.standard_normal((B, T, H, Dk)), dtype),
            jnp.asarray(rng.standard_normal((B, T, H, Dv)), dtype))


def _cuda_module(f, *args):
    return jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()


def _attention_and_gradients(impl, **kw):
    def f(q, k, v):
        loss = lambda q, k, v: jnp.sum(nsa.attention(q, k, v, g_cmp=q[..., 0], g_slc=q[..., 1], g_swa=q[..., 2],
                                                     implementation=impl, **kw).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return f


@needs_mosaic_gpu
@pytest.mark.parametrize("shape", [(1, 256, 32, 2, 128, 128, 64), (2, 100, 3, 1, 16, 8, 16),
                                   (1, 300, 16, 1, 192, 128, 32)], ids=["G16-D128", "G3-dv8", "Dk192"])
def test_attention_and_its_gradients_export_for_cuda(shape):
    """nsa.attention and its gradient with implementation="pallas", lowered for CUDA: every op is a Mosaic GPU
    kernel (each op's forward and backward kernels, and select's), none is Triton."""
    B, T, HQ, H, Dk, Dv, bs = shape
    module = _cuda_module(_attention_and_gradients("pallas", block_counts=4, block_size=bs, window_size=64),
                          *_inputs(B, T, HQ, H, Dk, Dv))
    # forward: select 1, compressed 1, selected 1, window 1; backward: compressed, window 2 each, selected 3
    assert module.count('custom_call @mosaic_gpu') >= 11, module.count('custom_call @mosaic_gpu')
    assert "triton_kernel_call" not in module


@needs_mosaic_gpu
def test_a_decode_step_exports_for_cuda():
    """A KV cache (ragged lengths) through the Mosaic GPU kernels, lowered for CUDA."""
    q, k, v = _inputs(2, 1, 32, 2, 128, 128)
    cache = jnp.zeros((2, 512, 2, 128), jnp.bfloat16)
    f = lambda q, k, v: nsa.attention(q, k, v, g_cmp=q[..., 0], block_counts=4, block_size=64, window_size=128,
                                      kv_lens=jnp.array([512, 77], jnp.int32), implementation="pallas")
    assert "mosaic_gpu" in _cuda_module(f, q, cache, cache)


@needs_mosaic_gpu
def test_without_jax_triton_the_default_is_mosaic_gpu(without_jax_triton):
    """With jax[cuda] alone (no jax-triton), implementation=None lowers to the Mosaic GPU kernels for 16-bit
    inputs, and to the reference for float32 (which the GPU kernels do not take)."""
    for dtype in (jnp.bfloat16, jnp.float16):
        chosen = nsa.implementations("cuda", dtype=dtype)
        assert {chosen[op] for op in KERNEL_OPS} == {"pallas"}, chosen
    assert set(nsa.implementations("cuda", dtype=jnp.float32).values()) == {"xla"}
    module = _cuda_module(_attention_and_gradients(None, block_counts=4, block_size=64, window_size=64),
                          *_inputs(1, 256, 32, 2, 128, 128))
    assert module.count("custom_call @mosaic_gpu") >= 11 and "triton_kernel_call" not in module


def test_with_jax_triton_the_default_on_cuda_follows_the_measured_preference(interpreted):
    """With jax-triton importable, implementation=None runs each op on CUDA (bfloat16) with the first family of
    nsa._families.PREFERENCE (the faster one on the H200) that this jax can lower: Pallas needs Mosaic GPU (jax >= 0.11)."""
    runs_here = {"triton": True, "pallas": MOSAIC_GPU_LOWERS}
    chosen = nsa.implementations("cuda")
    ops = ("compressed", "select", "selected", "window")
    assert {op: chosen[_dispatch.PUBLIC_NAMES[op]] for op in ops} == {
        op: next(family for family in _families.preferred(op, "cuda") if runs_here[family]) for op in ops}


@needs_mosaic_gpu
def test_explicit_pallas_on_float32_refuses_cuda():
    """The Mosaic GPU kernels take 16-bit inputs: lowering an explicit implementation="pallas" on float32 for
    CUDA raises, naming why (it never falls back), while the same program lowers for TPU."""
    q, k, v = _inputs(1, 64, 4, 2, 16, 16, jnp.float32)
    f = lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=8, implementation="pallas")
    with pytest.raises(TypeError, match="cannot run this op on a CUDA GPU: its Mosaic GPU kernels take bfloat16, "
                                        "float16"):
        _cuda_module(f, q, k, v)
    assert "tpu_custom_call" in jax.export.export(jax.jit(f), platforms=["tpu"])(q, k, v).mlir_module()


@pytest.mark.skipif(MOSAIC_GPU_LOWERS, reason="checks the dispatch of a jax without Mosaic GPU lowering (< 0.11)")
def test_an_older_jax_leaves_the_mosaic_gpu_kernels_out(without_jax_triton):
    """Before jax 0.11, implementation=None on CUDA cannot run the Mosaic GPU kernels: without jax-triton it
    runs the reference, and an explicit "pallas" lowered for CUDA says why."""
    assert set(nsa.implementations("cuda").values()) == {"xla"}
    assert "jax >= 0.11" in pallas.gpu_unavailable("selected", 0, jnp.bfloat16)


def test_the_gpu_plans_follow_the_device():
    """The Mosaic GPU flash kernels plan with the device's numbers (nsa._device): on an H200 (227 KiB of shared
    memory per block) the forward takes key tiles of 128 rows up to Dk + Dv = 256 and head dims up to 448 in all;
    on the table's smallest device (a program exported from a CPU: 163 KiB) 64-row tiles from 256 on and at most
    320; the dk/dv split aims at 4 programs per SM. Pure planning: no lowering, any jax."""
    from nsa import _config, _device
    from nsa._varlen import cdiv
    from nsa.pallas.gpu import _flash, selected

    h200, smallest = _device.TABLE["NVIDIA H200"], _device.CONSERVATIVE["cuda"]
    plan = lambda d, device: _flash.default_config(_config.Shapes(1, 64, 64, 2, 1, d, d), jnp.bfloat16, device)
    assert [plan(d, h200).forward_block_k for d in (64, 128, 160)] == [128, 128, 64]
    assert [plan(d, smallest).forward_block_k for d in (64, 128)] == [128, 64]

    def layout(dk, dv, device, T=64, NK=64, HQ=2, H=1):
        q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, T, HQ, dk), (1, NK, H, dk), (1, NK, H, dv)))
        lo = jnp.zeros((T,), jnp.int32)
        return _flash._Layout(q, k, v, lo, lo, plan(max(dk, dv), device)._replace(forward_block_k=64), device)

    layout(256, 192, h200)
    layout(192, 128, smallest)
    for (dk, dv), device in (((256, 256), h200), ((192, 192), smallest)):
        with pytest.raises(ValueError, match=f"q, v: expected head dims .* got Dk = {dk}, Dv = {dv}"):
            layout(dk, dv, device)
    # 32 key tiles of 16 KV heads, each seen by all 8192 queries of 8 query heads: 4 programs per SM in all
    parts = [_flash._dkdv_parts(layout(64, 64, device, 8192, 128, 128, 16), 8192) for device in (h200, smallest)]
    assert parts == [cdiv(4 * h200.cores, 32), cdiv(4 * smallest.cores, 32)] == [17, 14]
    with pytest.raises(ValueError, match="Config.slots: expected at least 2, got 1"):
        _flash.Config(slots=1)
    with pytest.raises(ValueError, match="Config.segment: expected a positive int, got 0"):
        selected.Config(segment=0)


@needs_mosaic_gpu
def test_the_window_backward_is_claimed_on_shorter_calls():
    """The Mosaic GPU window backward's claim on implementation=None's choice (nsa.pallas.gpu.CLAIMS) holds,
    statically, on training calls of fewer than BACKWARD_TOKENS tokens (B * T), and never on a KV cache's queries."""
    from nsa.pallas import gpu
    from nsa.pallas.gpu import window

    claim = gpu.CLAIMS[("window", 1)]
    assert claim.test is window.outruns_backward and claim.grads is None

    def holds(B, T, kv_lens=None):
        q, k, v = _inputs(B, T, 4, 2, 128, 128)
        o = jnp.zeros_like(q)
        return claim.test((q, k, v, None, kv_lens, o, o[..., 0]), o, window_size=64, scale=0.1)

    bound = window.BACKWARD_TOKENS
    assert holds(1, 128) is True and holds(2, bound // 2 - 1) is True
    assert holds(1, bound) is False and holds(2, bound // 2) is False
    assert holds(1, 128, kv_lens=jnp.array([128])) is False
