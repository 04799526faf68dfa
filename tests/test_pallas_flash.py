"""The Pallas TPU flash kernel of the window and compressed branches (nsa/pallas/_flash.py), forward.

On the CPU it runs in Pallas's TPU interpret mode (race detection on) against the XLA reference:
G = 1, 3 and 16, Dv != Dk, head dims that are not a multiple of 128 lanes, T not a multiple of the tile,
packed sequences with an empty one, rows that see nothing, float32 and bfloat16. It is also exported
for TPU (jax.export, platforms=["tpu"]) at the standard shape and an odd one, which lowers it through
Mosaic and so catches the layout and tiling errors that interpret mode lets through. No op dispatches
to it yet: its backward is to come.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import nsa
from nsa._varlen import compressed_key_range, window_key_range
from nsa.pallas import _flash
from tests.base import TOLERANCE, assert_close

CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200)
INTERPRET = pltpu.InterpretParams(detect_races=True)


def _inputs(B, T, HQ, H, Dk, Dv, dtype):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in ((B, T, HQ, Dk), (B, T, H, Dk), (B, T, H, Dv))]


# (B, T, HQ, H, Dk, Dv), window_size, block_size, cu_seqlens, dtype
CASES = {
    "G2-dk64-dv32-T300": ((1, 300, 4, 2, 64, 32), 100, 16, None, "float32"),
    "G3-w1-bs8-B2": ((2, 130, 3, 1, 32, 32), 1, 8, None, "float32"),
    "G16-w>T-varlen": ((1, 200, 16, 1, 128, 128), 1000, 32, CU, "float32"),
    "G1-bf16": ((1, 256, 4, 4, 128, 64), 64, 64, None, "bfloat16"),
}


@pytest.mark.parametrize("shape, window_size, block_size, cu, dtype", CASES.values(), ids=CASES.keys())
def test_forward_matches_the_reference_in_interpret_mode(shape, window_size, block_size, cu, dtype):
    B, T, HQ, H, Dk, Dv = shape
    q, k, v = _inputs(B, T, HQ, H, Dk, Dv, dtype)
    cu_j = None if cu is None else jnp.asarray(cu)
    f32 = lambda x: x.astype(jnp.float32)
    scale = Dk ** -0.5
    k_cmp, v_cmp = (nsa.compress(x, block_size=block_size, cu_seqlens=cu_j) for x in (k, v))
    cases = [
        (k, v, window_key_range(T, window_size, cu_j), 128 + window_size - 1,
         nsa.sliding_window_attention(f32(q), f32(k), f32(v), window_size=window_size, cu_seqlens=cu_j,
                                      implementation="xla"), None),
        (k_cmp, v_cmp, compressed_key_range(T, k_cmp.shape[1], block_size, cu_j), k_cmp.shape[1],
         *nsa.compressed_attention(f32(q), f32(k_cmp), f32(v_cmp), block_size=block_size, cu_seqlens=cu_j,
                                   implementation="xla")),
    ]
    for keys, values, (lo, hi), span, o_ref, lse_ref in cases:
        o, lse = jax.jit(lambda q, k, v: _flash.attend(q, k, v, lo, hi, scale=scale, key_span=span,
                                                       interpret=INTERPRET))(q, keys, values)
        assert o.dtype == q.dtype and o.shape == o_ref.shape and lse.dtype == jnp.float32
        assert_close(o, o_ref, TOLERANCE[dtype], "o")
        if lse_ref is not None:
            lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
            seen = np.isfinite(lse_ref)
            assert_close(lse[seen], lse_ref[seen], TOLERANCE[dtype], "lse")


@pytest.mark.parametrize("shape, dtype", [((1, 8192, 64, 4, 128, 128), jnp.bfloat16),  # the standard shape
                                          ((1, 1000, 6, 2, 64, 48), jnp.float32)],  # G = 3, Dv != Dk
                         ids=["standard-bf16", "odd-f32"])
def test_lowers_for_tpu(shape, dtype):
    """jax.export for TPU lowers the kernel through Mosaic (a tpu_custom_call), window and compressed."""
    B, T, HQ, H, Dk, Dv = shape
    for NK, (lo, hi), span in [(T, window_key_range(T, 512), 128 + 511),
                               (-(-T // 64), compressed_key_range(T, -(-T // 64), 64), -(-T // 64))]:
        f = jax.jit(lambda q, k, v: _flash.attend(q, k, v, lo, hi, scale=0.1, key_span=span))
        args = [jax.ShapeDtypeStruct(s, dtype) for s in ((B, T, HQ, Dk), (B, NK, H, Dk), (B, NK, H, Dv))]
        module = jax.export.export(f, platforms=["tpu"])(*args).mlir_module()
        assert module.count("tpu_custom_call") == 1


@pytest.mark.parametrize("dk, dv, itemsize", [(128, 128, 2), (256, 256, 4), (16, 256, 4)])
def test_vmem_budget(dk, dv, itemsize):
    """Every block double-buffered plus the scratch, up to the widest heads of the contract (256) in
    float32: within the 16 MiB of scoped VMEM that Mosaic gives a kernel by default on v5e, v5p and v6e
    (whose VMEM is 64 to 128 MiB)."""
    assert _flash.vmem_bytes(dk, dv, itemsize) <= 16 * 2 ** 20
