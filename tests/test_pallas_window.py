"""The window branch's splash attention path (nsa.pallas.tpu.window.by_splash) in Pallas's TPU interpret mode: the
forward (o and lse) and the gradients against the XLA reference, plain and packed, grouped heads and Dv != Dk, and
which inputs it takes (the rest run the flash kernels, tested with the shared base in test_pallas.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from nsa.pallas.tpu import _flash, selected, window
from nsa.reference import window as reference
from tests.base import GRAD_TOLERANCE, TOLERANCE, Inputs, assert_close, gradient_scales

INTERPRET = pltpu.InterpretParams(detect_races=True)
CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200, not a multiple of 128)

# (B, T, HQ, H, Dk, Dv), dtype, window_size, cu_seqlens
CASES = {
    "G3-dv256-w40": ((1, 200, 3, 1, 128, 256), "float32", 40, None),
    "G1-B2-w1-bf16": ((2, 130, 2, 2, 128, 128), "bfloat16", 1, None),
    "G2-packed-w64": ((1, 200, 4, 2, 128, 128), "float32", 64, CU),
    "G2-packed-w300-bf16": ((1, 200, 4, 2, 128, 128), "bfloat16", 300, CU),
}


# the resident kernels' (window.resident): G a multiple of the sublanes (16 in bfloat16, 8 in float32)
RESIDENT_CASES = {
    "G16-w40-bf16": ((1, 200, 16, 1, 128, 128), "bfloat16", 40, None),
    "G8-packed-w64-dv256": ((1, 200, 16, 2, 128, 256), "float32", 64, CU),
    "G16-B2-w300-bf16": ((2, 130, 32, 2, 128, 128), "bfloat16", 300, None),
}


@pytest.mark.parametrize("shape, dtype, window_size, cu", CASES.values(), ids=CASES.keys())
def test_splash_matches_the_reference(shape, dtype, window_size, cu, monkeypatch):
    monkeypatch.setattr(window, "RESIDENT_WINDOW", False)
    x = Inputs(shape + (1,), dtype)
    assert window.by_splash(x.q, x.v, None, window_size, None)
    _matches_the_reference(x, shape, dtype, window_size, cu)


@pytest.mark.parametrize("shape, dtype, window_size, cu", RESIDENT_CASES.values(), ids=RESIDENT_CASES.keys())
def test_resident_matches_the_reference(shape, dtype, window_size, cu):
    x = Inputs(shape + (1,), dtype)
    assert window.resident(x.q, x.k, x.v, None, window_size, None, backward=True) is not None
    _matches_the_reference(x, shape, dtype, window_size, cu)


def _matches_the_reference(x, shape, dtype, window_size, cu):
    cu = None if cu is None else jnp.asarray(cu)
    scale = shape[4] ** -0.5
    kw = dict(window_size=window_size, scale=scale)
    o, res = window.forward(x.q, x.k, x.v, cu, None, interpret=INTERPRET, **kw)
    grads = window.backward(res, x.do, interpret=INTERPRET, **kw)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    o_ref, res_ref = reference.forward(f32(x.q), f32(x.k), f32(x.v), cu, None, **kw)
    grads_ref = reference.backward(res_ref, f32(x.do), **kw)
    assert o.dtype == x.q.dtype and res[-1].dtype == jnp.float32 and grads[3:] == (None, None)
    assert_close(o, o_ref, TOLERANCE[dtype], "o")
    assert_close(res[-1], res_ref[-1], TOLERANCE[dtype], "lse")
    for name, g, g_ref, arg, size in zip(("dq", "dk", "dv"), grads, grads_ref, (x.q, x.k, x.v),
                                         gradient_scales(x.q, x.k, x.v, x.do, scale)):
        assert g.dtype == arg.dtype and g.shape == arg.shape, name
        assert_close(g, g_ref, GRAD_TOLERANCE[dtype], name, size)


def test_what_splash_takes():
    """bfloat16 and float32 heads of whole lanes, a window of at least one key, no KV cache, no flash Config."""
    q, v = jnp.zeros((1, 8, 2, 128), jnp.bfloat16), jnp.zeros((1, 8, 1, 256), jnp.bfloat16)
    assert window.by_splash(q, v, None, 4, None)
    assert window.by_splash(q.astype(jnp.float32), v, None, 4, None)
    assert not window.by_splash(q.astype(jnp.float16), v, None, 4, None)
    assert not window.by_splash(q, v, jnp.array([8]), 4, None)
    assert not window.by_splash(q, v, None, 4, _flash.Config())
    assert not window.by_splash(q, v, None, 0, None)
    assert not window.by_splash(q[..., :64], v, None, 4, None)
    assert not window.by_splash(q, v[..., :64], None, 4, None)


def test_resident_backward_in_two_passes_is_bitwise_one(monkeypatch):
    """Where one pass does not fit in VMEM (64k tokens at the standard shape), the backward runs (dq, dk) and then
    (dv): each sum is added to in the same order, so the gradients are bitwise those of one pass."""
    shape, dtype, window_size, cu = RESIDENT_CASES["G8-packed-w64-dv256"]
    x = Inputs(shape + (1,), dtype)
    kw = dict(window_size=window_size, scale=shape[4] ** -0.5, interpret=INTERPRET)
    _, res = window.forward(x.q, x.k, x.v, jnp.asarray(cu), None, **kw)
    one = window.backward(res, x.do, **kw)
    monkeypatch.setattr(selected, "BACKWARD_PLANS", ((("dq", "dk"), ("dv",)),))
    assert window.resident(x.q, x.k, x.v, None, window_size, None, backward=True)[1] == (("dq", "dk"), ("dv",))
    two = window.backward(res, x.do, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), one, two):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_what_the_resident_kernels_take():
    """Training (no KV cache, no flash Config, a window of at least one key) in bfloat16 or float32 with G a multiple
    of the sublanes (16 in bfloat16, 8 in float32); the rest goes to splash or the flash kernels."""
    q, k = jnp.zeros((1, 64, 16, 128), jnp.bfloat16), jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
    assert window.resident(q, k, k, None, 8, None, backward=True) is not None
    assert window.resident(q.astype(jnp.float32), k, k, None, 8, None, backward=True) is not None
    assert window.resident(q[:, :, :8].astype(jnp.float32), k, k, None, 8, None, backward=True) is not None
    assert window.resident(q[:, :, :8], k, k, None, 8, None, backward=True) is None  # G = 8 in bfloat16
    assert window.resident(q.astype(jnp.float16), k, k, None, 8, None, backward=True) is None
    assert window.resident(q, k, k, jnp.array([64]), 8, None, backward=True) is None
    assert window.resident(q, k, k, None, 8, _flash.Config(), backward=True) is None
    assert window.resident(q, k, k, None, 0, None, backward=True) is None
