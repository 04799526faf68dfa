"""nsa in jax's x64 mode (jax_enable_x64 on) on 16- and 32-bit inputs, as a program that uses float64 elsewhere
runs it: the shared test base (tests/base.py) on a few representative cases of the XLA reference and the Pallas
kernels in interpret mode (not the whole base twice), and nsa.attention exported with every kernel for TPU (Mosaic
TPU) and CUDA (Mosaic GPU), whose lowerings refuse 64-bit values that interpret mode lets through. Not the Triton
interpreter: it ran the whole base in x64 mode (2026-12-06, issue 51) and passed, and the Pallas family's 32-bit
tracing (`in_32_bits`), where x64 broke kernels, is not its code; CI's time goes to the cases that found bugs.

The representative cases: the whole pipeline forward (every op's kernel) in a 32-bit dtype, its forward and
gradients in a 16-bit one, ragged steps over a paged and a contiguous cache (jitted, lengths traced), and packed sequences
(a concrete and a traced cu_seqlens).
"""

import re

import jax
import jax.numpy as jnp
import pytest

import nsa
from tests import test_pallas, test_xla
from tests.base import MOSAIC_GPU_LOWERS

TESTS = ("test_attention", "test_gradients", "test_ragged_steps_over_a_paged_cache_equal_full_recompute",
         "test_varlen_equals_each_sequence_alone")


def in_x64_mode(family):
    """The subclass of `family` (a subclass of the test base) that runs TESTS alone, in x64 mode, on representative
    cases: the whole pipeline forward (its first variant) on a 32-bit case, its forward and gradients on a 16-bit
    one, the first case of the other kinds (the varlen tests: the pipeline's)."""

    class InX64Mode(family):
        x64 = True

        @classmethod
        def case_params(cls, kind, **variants):
            names, params = super().case_params(kind, **{name: values[:1] for name, values in variants.items()})
            if kind == "gradients":
                return names, [p for p in params if p.values[0] == "attention"]
            if kind == "varlen":
                return names, ["attention"]
            return names, params if kind == "attention" else params[:1]

        @classmethod
        def _shape_dtypes(cls, kind):
            sixteen = next(dtype for dtype in cls.dtypes if dtype in ("bfloat16", "float16"))
            return {"attention": [("G3-dv8", "float32")], "gradients": [("G3-dv8", sixteen)]}[kind]

    for name in dir(family):
        if name.startswith("test_") and name not in TESTS:
            setattr(InX64Mode, name, None)
    InX64Mode.__name__ = InX64Mode.__qualname__ = f"{family.__name__}InX64Mode"
    return InX64Mode


TestXLAInX64Mode = in_x64_mode(test_xla.TestXLA)
TestPallasInterpretedInX64Mode = in_x64_mode(test_pallas.TestPallasInterpreted)


@pytest.mark.parametrize("platform, dtype", [("tpu", jnp.float32), ("tpu", jnp.bfloat16),
                                             pytest.param("cuda", jnp.bfloat16, marks=pytest.mark.skipif(
                                                 not MOSAIC_GPU_LOWERS, reason="Mosaic GPU lowers from jax 0.11"))])
def test_attention_and_gradients_export_with_every_kernel_in_x64_mode(platform, dtype):
    """nsa.attention (every branch; the paper's overlapping compression, so Eq. 9's select too) and its gradients,
    implementation="pallas", exported for TPU and CUDA in x64 mode: each lowers to the kernels it lowers to in
    32-bit mode."""
    B, T, HQ, H, D = 1, 256, 4, 2, 128  # heads of 128 lanes: on TPU the window runs splash attention
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape in [(B, T, HQ, D), (B, T, H, D), (B, T, H, D), (B, T, HQ)]]

    def loss(q, k, v, g):
        o = nsa.attention(q, k, v, g_cmp=g, g_slc=g, g_swa=g, block_counts=4, block_size=32, compress_block_size=16,
                          compress_stride=8, window_size=64, implementation="pallas")
        return jnp.sum(o.astype(jnp.float32))

    def kernels():
        module = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=range(4))), platforms=[platform])(
            *args).mlir_module()
        return sorted(re.findall(r'kernel_name = "(\w+)"|custom_call @(mosaic_gpu)', module))

    in_32_bits = kernels()
    assert len(in_32_bits) > 4, in_32_bits  # the 4 ops' forward kernels (select, compressed, selected, window), and more
    # for the backward
    with jax.enable_x64(True):
        assert kernels() == in_32_bits
