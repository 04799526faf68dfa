"""The compressed branch's splash attention path (nsa.pallas.tpu.compressed.by_splash) and its resident kernels
(compressed.resident, nsa/pallas/tpu/_resident.py) in Pallas's TPU interpret mode: the forward (o and lse) and the
gradients, with a nonzero cotangent of lse, against the XLA reference; compression 64 / 64 and the paper's 32 / 16,
grouped heads, Dv != Dk, T and NC padded, packed sequences (resident); the queries that see no compressed row (o = 0,
lse = -inf, zero gradients, no NaN), also a whole tile of them; and which inputs each takes (the rest run the flash
kernels, tested with the shared base in test_pallas.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from nsa._varlen import cdiv, num_compressed_blocks
from nsa.pallas.tpu import _flash, _resident, compressed
from nsa.reference import compressed as reference
from tests.base import GRAD_TOLERANCE, TOLERANCE, assert_close, gradient_scales, rounded

INTERPRET = pltpu.InterpretParams(detect_races=True)

# (B, T, HQ, H, Dk, Dv), dtype, block_size, stride
CASES = {
    "G1-B2-l64-d64": ((2, 256, 2, 2, 128, 128), "float32", 64, 64),
    "G3-dv256-l32-d16": ((1, 200, 6, 2, 128, 256), "float32", 32, 16),
    "G3-l32-d16-bf16": ((1, 384, 3, 1, 128, 128), "bfloat16", 32, 16),
    "G16-l64-d64-bf16": ((1, 200, 16, 1, 128, 128), "bfloat16", 64, 64),
    # tiles of 128 queries (T = 384): the first sees no row at all
    "G2-l256-d256-blind-tile": ((1, 384, 2, 1, 128, 128), "float32", 256, 256),
}

CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200)

# the resident kernels' (compressed.resident): G a multiple of the sublanes (16 in bfloat16, 8 in float32);
# (B, T, HQ, H, Dk, Dv), dtype, block_size, stride, cu_seqlens
RESIDENT_CASES = {
    "G16-l64-d64-bf16": ((1, 200, 16, 1, 128, 128), "bfloat16", 64, 64, None),
    "G8-packed-l32-d16-dv256": ((1, 200, 16, 2, 128, 256), "float32", 32, 16, CU),
    "G16-B2-l32-d16-bf16": ((2, 130, 32, 2, 128, 128), "bfloat16", 32, 16, None),
}


def _inputs(shape, dtype, stride, seed=0, cu=None):
    """q, k_cmp, v_cmp (NC = ceil(T / stride) rows, or their sum over the sequences of `cu`, as `compress` makes
    them), do and dlse, random in `dtype` (dlse float32, as lse)."""
    B, T, HQ, H, Dk, Dv = shape
    NC = num_compressed_blocks(T, stride, None if cu is None else jnp.asarray(cu))
    rng = np.random.default_rng(seed)
    draw = lambda *s, dt=dtype: rounded(rng.standard_normal(s), dt)[0]
    return (draw(B, T, HQ, Dk), draw(B, NC, H, Dk), draw(B, NC, H, Dv), draw(B, T, HQ, Dv),
            draw(B, T, HQ, dt="float32"))


@pytest.mark.parametrize("shape, dtype, block_size, stride", CASES.values(), ids=CASES.keys())
def test_splash_matches_the_reference(shape, dtype, block_size, stride, monkeypatch):
    monkeypatch.setattr(compressed, "RESIDENT_COMPRESSED", False)
    q, k_cmp, v_cmp, do, dlse = _inputs(shape, dtype, stride)
    assert compressed.by_splash(q, k_cmp, v_cmp, None, None, None)
    _matches_the_reference(shape, dtype, block_size, stride, None, q, k_cmp, v_cmp, do, dlse)


@pytest.mark.parametrize("shape, dtype, block_size, stride, cu", RESIDENT_CASES.values(), ids=RESIDENT_CASES.keys())
def test_resident_matches_the_reference(shape, dtype, block_size, stride, cu):
    q, k_cmp, v_cmp, do, dlse = _inputs(shape, dtype, stride, cu=cu)
    assert compressed.resident(q, k_cmp, v_cmp, None, None, backward=True) is not None
    _matches_the_reference(shape, dtype, block_size, stride, cu, q, k_cmp, v_cmp, do, dlse)


@pytest.mark.parametrize("cu", [None, np.array([0, 300, 300, 640], np.int32)], ids=["one", "packed"])
def test_resident_prefixes_match_the_reference(cu, monkeypatch):
    """A step reads the shortest prefix of the compressed rows that its tokens see (`_resident.Layout.spans`): with
    prefixes of 128 rows, 159 rows (windows of 8 every 4 over 640 tokens) run in steps of 128 and of 256 rows, the
    later tokens of each sequence seeing past row 128."""
    monkeypatch.setattr(_resident, "PREFIX_ROWS", 128)
    shape, dtype, block_size, stride = (1, 640, 16, 1, 128, 128), "bfloat16", 8, 4
    q, k_cmp, v_cmp, do, dlse = _inputs(shape, dtype, stride, cu=cu)
    lay, _ = compressed.resident(q, k_cmp, v_cmp, None, None, backward=True)
    assert lay.spans == (128, 256)
    _matches_the_reference(shape, dtype, block_size, stride, cu, q, k_cmp, v_cmp, do, dlse)


def test_prefix_lengths(monkeypatch):
    """Multiples of PREFIX_ROWS up to SPAN, at most PREFIX_VARIANTS of them (a longer quantum, whole lanes); a step
    that slides (the window) reads SPAN always."""
    lay = lambda span, advance=0: _resident.Layout(1, 64, 1, 16, 16, 4, 128, 128, span, 0, advance, span)
    assert lay(4096).spans == tuple(range(512, 4097, 512))
    assert lay(1024).spans == (512, 1024) and lay(640).spans == (512, 640) and lay(512).spans == (512,)
    assert lay(128).spans == (128,) and lay(1024, advance=16).spans == (1024,)
    monkeypatch.setattr(_resident, "PREFIX_VARIANTS", 3)
    assert lay(4096).spans == (1408, 2816, 4096)


def _matches_the_reference(shape, dtype, block_size, stride, cu, q, k_cmp, v_cmp, do, dlse):
    cu = None if cu is None else jnp.asarray(cu)
    scale = shape[4] ** -0.5
    kw = dict(block_size=block_size, stride=stride, scale=scale)
    (o, lse), res = compressed.forward(q, k_cmp, v_cmp, cu, None, interpret=INTERPRET, **kw)
    grads = compressed.backward(res, (do, dlse), interpret=INTERPRET, **kw)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    (o_ref, lse_ref), res_ref = reference.forward(f32(q), f32(k_cmp), f32(v_cmp), cu, None, **kw)
    grads_ref = reference.backward(res_ref, (f32(do), dlse), **kw)

    blind = (np.asarray(lse_ref) == -np.inf).all(axis=(0, 2))  # the queries before their sequence's first window
    assert blind[: block_size - 1].all() and not blind.all()
    assert cu is not None or (blind == (np.arange(shape[1]) < block_size - 1)).all()
    assert o.dtype == q.dtype and lse.dtype == jnp.float32 and grads[3:] == (None, None)
    assert np.all(np.asarray(o)[:, blind] == 0) and np.all(np.asarray(lse)[:, blind] == -np.inf)
    assert np.all(np.asarray(lse_ref)[:, blind] == -np.inf)
    assert_close(o, o_ref, TOLERANCE[dtype], "o")
    assert_close(lse[:, ~blind], lse_ref[:, ~blind], TOLERANCE[dtype], "lse")
    for name, g, g_ref, arg, size in zip(("dq", "dk_cmp", "dv_cmp"), grads, grads_ref, (q, k_cmp, v_cmp),
                                         gradient_scales(q, k_cmp, v_cmp, do, scale)):
        assert g.dtype == arg.dtype and g.shape == arg.shape, name
        assert_close(g, g_ref, GRAD_TOLERANCE[dtype], name, size)  # also: finite everywhere
    assert np.all(np.asarray(grads[0])[:, blind] == 0)


def test_what_splash_takes():
    """bfloat16 and float32 heads of whole lanes, at least one compressed row, no KV cache, no packed sequences, no
    flash Config."""
    q, v = jnp.zeros((1, 8, 2, 128), jnp.bfloat16), jnp.zeros((1, 2, 1, 256), jnp.bfloat16)
    k = jnp.zeros((1, 2, 1, 128), jnp.bfloat16)
    assert compressed.by_splash(q, k, v, None, None, None)
    assert compressed.by_splash(q.astype(jnp.float32), k, v, None, None, None)
    assert not compressed.by_splash(q.astype(jnp.float16), k, v, None, None, None)
    assert not compressed.by_splash(q, k, v, None, jnp.array([8]), None)
    assert not compressed.by_splash(q, k, v, jnp.array([0, 3, 8]), None, None)
    assert not compressed.by_splash(q, k, v, None, None, _flash.Config())
    assert not compressed.by_splash(q, k[:, :0], v[:, :0], None, None, None)
    assert not compressed.by_splash(q[..., :64], k[..., :64], v, None, None, None)
    assert not compressed.by_splash(q, k, v[..., :64], None, None, None)


def test_what_the_resident_kernels_take(monkeypatch):
    """Training (no KV cache, no flash Config) in bfloat16 or float32 with G a multiple of the sublanes (16 in
    bfloat16, 8 in float32), from 1 to RESIDENT_COMPRESSED_ROWS compressed rows; the rest goes to splash or the flash
    kernels."""
    monkeypatch.setattr(compressed, "RESIDENT_COMPRESSED_ROWS", 256)  # within any TPU's VMEM (off a TPU: 16 MiB)
    q, k = jnp.zeros((1, 64, 16, 128), jnp.bfloat16), jnp.zeros((1, 4, 1, 128), jnp.bfloat16)
    assert compressed.resident(q, k, k, None, None, backward=True) is not None
    assert compressed.resident(q.astype(jnp.float32), k, k, None, None, backward=True) is not None
    assert compressed.resident(q[:, :, :8].astype(jnp.float32), k, k, None, None, backward=True) is not None
    assert compressed.resident(q[:, :, :8], k, k, None, None, backward=True) is None  # G = 8 in bfloat16
    assert compressed.resident(q.astype(jnp.float16), k, k, None, None, backward=True) is None
    assert compressed.resident(q, k, k, jnp.array([64]), None, backward=True) is None
    assert compressed.resident(q, k, k, None, _flash.Config(), backward=True) is None
    assert compressed.resident(q, k[:, :0], k[:, :0], None, None, backward=True) is None
    many = jnp.zeros((1, compressed.RESIDENT_COMPRESSED_ROWS + 1, 1, 128), jnp.bfloat16)
    assert compressed.resident(q, many, many, None, None, backward=True) is None
    assert compressed.resident(q, many[:, 1:], many[:, 1:], None, None, backward=True) is not None
