"""nsa exported with jax.export: one artifact for several platforms, and a symbolic batch.

A serving stack exports one program for every platform it serves on (jax.export's `platforms`). nsa's dispatch
(nsa._platform.platform_dependent) lowers each platform's branch for that platform alone, so the module holds, for
each platform, what exporting for it alone gives: TPU's Mosaic kernels (tpu_custom_call, by kernel name), CUDA's
Mosaic GPU kernels where this jax lowers them (jax >= 0.11, 16-bit inputs; jax_triton does not import on this
CPU-only jaxlib, so no Triton), and the reference elsewhere; its CPU part runs here and equals the reference. A
symbolic batch (jax.export.symbolic_shape) exports for every platform and runs at any batch; the other dimensions
must be static, and say so.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa import pallas
from nsa.pallas._batch import per_sequence
from tests.base import MOSAIC_GPU_LOWERS, TOLERANCE, assert_close
from tests.test_pallas import FORWARD_KERNELS, training_kernels

# the Mosaic kernels of each case's forward (D = 32: the window's flash kernels)
CASE_KERNELS = {"attention": training_kernels(backward=False), "cache": FORWARD_KERNELS}

PLATFORM_SETS = [("cpu", "tpu"), ("cpu", "cuda"), ("cuda", "tpu"), ("cpu", "cuda", "tpu")]
DTYPES = ["float32", "bfloat16"]
HQ, H, D, T, BLOCK = 4, 2, 32, 256, 32
CONFIG = dict(block_counts=4, block_size=BLOCK, window_size=64)


def _random(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _attention_case(dtype, B):
    """nsa.attention with every branch on: (f(implementation) -> fn, its arguments)."""
    gate = jax.nn.sigmoid(_random((B, T, HQ), jnp.float32, 3)).astype(dtype)
    args = (_random((B, T, HQ, D), dtype, 0), _random((B, T, H, D), dtype, 1), _random((B, T, H, D), dtype, 2), gate)

    def make(implementation):
        return lambda q, k, v, g: nsa.attention(q, k, v, g_cmp=g, g_slc=g, g_swa=g, implementation=implementation,
                                                **CONFIG)
    return make, args


def _cache_case(dtype, B):
    """A decode step over a KV cache of ragged sequences, every branch on: (make, (q, cache, gate))."""
    prompt = 200
    cache = nsa.prefill_cache(_random((B, prompt, H, D), dtype, 1), _random((B, prompt, H, D), dtype, 2),
                              block_size=BLOCK, capacity=T, lens=np.arange(B) * 37 % prompt + 100)
    cache = nsa.append_to_cache(cache, _random((B, 1, H, D), dtype, 4), _random((B, 1, H, D), dtype, 5))
    gate = jax.nn.sigmoid(_random((B, 1, HQ), jnp.float32, 3)).astype(dtype)

    def make(implementation):
        return lambda q, cache, g: nsa.attention(q, cache=cache, g_cmp=g, g_slc=g, g_swa=g,
                                                 implementation=implementation, block_counts=4, window_size=64)
    return make, (_random((B, 1, HQ, D), dtype, 0), cache, gate)


CASES = {"attention": _attention_case, "cache": _cache_case}


def _kernels(module):
    """What an exported module's text holds: (the names of its Mosaic TPU kernels, its Mosaic GPU calls, whether
    it has a Triton call)."""
    return (set(re.findall(r'kernel_name = "(\w+)"', module)), module.count("custom_call @mosaic_gpu"),
            "triton_kernel_call" in module)


def _export(f, platforms, *args):
    return jax.export.export(jax.jit(f), platforms=list(platforms))(*args)


@functools.cache
def _alone(case, dtype, platform):
    """`_kernels` of the case exported for `platform` alone (B = 2)."""
    make, args = CASES[case](dtype, 2)
    return _kernels(_export(make(None), [platform], *args).mlir_module())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("platforms", PLATFORM_SETS, ids=["+".join(p) for p in PLATFORM_SETS])
def test_exports_for_several_platforms(platforms, case, dtype):
    """implementation=None exported for several platforms at once: the module holds each platform's kernels as
    exporting for it alone does (TPU's Mosaic kernels, CUDA's Mosaic GPU ones for bfloat16 where this jax lowers
    them), and its CPU part runs the reference."""
    make, args = CASES[case](dtype, 2)
    exported = _export(make(None), platforms, *args)
    tpu_names, mosaic_gpu_calls, triton = _kernels(exported.mlir_module())
    assert not triton
    assert tpu_names == (_alone(case, dtype, "tpu")[0] if "tpu" in platforms else set())
    assert _alone(case, dtype, "tpu")[0] == CASE_KERNELS[case]
    cuda_calls = _alone(case, dtype, "cuda")[1] if "cuda" in platforms else 0
    assert mosaic_gpu_calls == cuda_calls
    assert (cuda_calls > 0) == ("cuda" in platforms and MOSAIC_GPU_LOWERS and dtype == "bfloat16")
    if "cpu" in platforms:
        assert_close(exported.call(*args), jax.jit(make("xla"))(*args), TOLERANCE[dtype], "o (exported, on the CPU)")


def test_gradient_exports_for_several_platforms():
    """The forward and backward of nsa.attention exported for the CPU and TPU: the TPU part holds every backward
    kernel too, the CPU part gives the reference's gradient."""
    make, args = _attention_case("float32", 2)
    grad = jax.grad(lambda *a: jnp.sum(make(None)(*a) ** 2), argnums=(0, 1, 2, 3))
    exported = _export(grad, ("cpu", "tpu"), *args)
    assert {"compressed_dq", "selected_resident_backward", "window_dkdv"} < _kernels(exported.mlir_module())[0]
    want = jax.jit(jax.grad(lambda *a: jnp.sum(make("xla")(*a) ** 2), argnums=(0, 1, 2, 3)))(*args)
    for got, ref, name in zip(exported.call(*args), want, ("dq", "dk", "dv", "dg")):
        assert_close(got, ref, TOLERANCE["float32"], name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_pallas_exports_for_cuda_and_tpu(dtype):
    """implementation="pallas" exported for CUDA and TPU: Mosaic GPU and Mosaic TPU kernels where this jax lowers
    the GPU ones on this dtype; elsewhere lowering for CUDA raises, naming why (an explicit kernel never falls
    back)."""
    make, args = _attention_case(dtype, 2)
    why_not = pallas.gpu_unavailable("window", 0, jnp.dtype(dtype))
    if why_not is not None:
        with pytest.raises(TypeError, match=re.escape(f"implementation='pallas' cannot run this op on a CUDA GPU: "
                                                      f"{why_not}")):
            _export(make("pallas"), ("cuda", "tpu"), *args)
        return
    tpu_names, mosaic_gpu_calls, _ = _kernels(_export(make("pallas"), ("cuda", "tpu"), *args).mlir_module())
    assert tpu_names == CASE_KERNELS["attention"] and mosaic_gpu_calls == _alone("attention", dtype, "cuda")[1] > 0


def test_explicit_pallas_does_not_export_for_the_cpu():
    """implementation="pallas" runs its TPU interpret mode on the CPU, host callbacks that jax.export cannot
    serialize: exporting it for the CPU raises (export implementation=None or 'xla' there)."""
    make, args = _attention_case("float32", 2)
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        _export(make("pallas"), ("cpu", "tpu"), *args)


def _symbolic_batch(args):
    """args as ShapeDtypeStructs whose batch (axis 0 of every array) is the symbolic dimension 'b'."""
    (b,) = jax.export.symbolic_shape("b")
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype), args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_symbolic_batch(case, dtype):
    """implementation=None exported with a symbolic batch for the CPU, CUDA and TPU: each platform's kernels are
    there (the TPU and GPU kernels that cannot take a symbolic grid or table run once per sequence), and the CPU
    part runs at any batch, as the reference."""
    make, args = CASES[case](dtype, 2)
    exported = _export(make(None), ("cpu", "cuda", "tpu"), *_symbolic_batch(args))
    tpu_names, mosaic_gpu_calls, _ = _kernels(exported.mlir_module())
    assert tpu_names == CASE_KERNELS[case]
    assert (mosaic_gpu_calls > 0) == (MOSAIC_GPU_LOWERS and dtype == "bfloat16")
    for B in (1, 3):
        _, args = CASES[case](dtype, B)
        assert_close(exported.call(*args), jax.jit(make("xla"))(*args), TOLERANCE[dtype], f"o at B = {B}")


def test_symbolic_sequence_length_raises():
    """Only the batch may be symbolic: a symbolic T (q's) or N (a cache's capacity) raises, naming the dimension."""
    make, args = _attention_case("float32", 2)
    (t,) = jax.export.symbolic_shape("t")
    specs = [jax.ShapeDtypeStruct((x.shape[0], t) + x.shape[2:], x.dtype) for x in args]
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(T\) must be static: .* got the symbolic dimension 't'"):
        _export(make(None), ["cpu"], *specs)
    make, (q, cache, gate) = _cache_case("float32", 2)
    cache = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0], t) + x.shape[2:], x.dtype) if x.ndim == 4 else x, cache)
    with pytest.raises(ValueError, match=r"cache.k.shape\[1\] \(N\) must be static: .* got the symbolic dimension 't'"):
        _export(make(None), ["cpu"], q, cache, gate)


def test_per_sequence_maps_a_symbolic_batch():
    """per_sequence (the kernels that take no symbolic batch) runs fn on each sequence alone when the batch is
    symbolic, passing the arrays without a batch axis whole, and calls fn itself on a static batch."""
    seen = []

    def fn(x, shared, *, scale):
        seen.append(x.shape[0])
        return x * shared * scale, jnp.sum(x, axis=1)

    run = per_sequence(fn)
    x, shared = _random((3, 5), jnp.float32, 0), _random((5,), jnp.float32, 1)
    want = fn(x, shared, scale=2.0)
    exported = jax.export.export(jax.jit(lambda x, s: run(x, s, scale=2.0)), platforms=["cpu"])(
        *_symbolic_batch((x,)), shared)
    assert seen[-1] == 1
    for got, ref in zip(exported.call(x, shared), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)
    run(x, shared, scale=2.0)
    assert seen[-1] == 3
