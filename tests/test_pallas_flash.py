"""The Pallas TPU flash kernels of the window and compressed branches (nsa/pallas/tpu/_flash.py).

On the CPU it runs in Pallas's TPU interpret mode (race detection on) against the XLA reference:
G = 1, 3 and 16, Dv != Dk, head dims that are not a multiple of 128 lanes, T not a multiple of the tile,
packed sequences with an empty one, rows that see nothing, queries at the end of a KV cache's ragged
sequences (ranges per batch row over several tiles, NaN keys past each length), float32 and bfloat16: o,
lse, and dq, dk, dv (with a cotangent on lse) against the reference's gradients. Forward and backward are
also exported for TPU (jax.export, platforms=["tpu"]) at the standard shape and an odd one, which lowers
them through Mosaic and so catches the layout and tiling errors that interpret mode lets through. The
window and compressed ops run them (nsa/pallas/tpu/window.py, compressed.py), where the shared test base
checks them too (tests/test_pallas.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import nsa
from nsa._varlen import compressed_key_range, window_key_range
from nsa.pallas.tpu import _flash
from tests.base import GRAD_TOLERANCE, TOLERANCE, assert_close, gradient_scales

CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200)
INTERPRET = pltpu.InterpretParams(detect_races=True)


def _inputs(B, T, HQ, H, Dk, Dv, dtype):
    """q, k, v and a cotangent do."""
    rng = np.random.default_rng(0)
    shapes = ((B, T, HQ, Dk), (B, T, H, Dk), (B, T, H, Dv), (B, T, HQ, Dv))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


# (B, T, HQ, H, Dk, Dv), window_size, block_size, cu_seqlens, dtype
CASES = {
    "G2-dk64-dv32-T300-bs2": ((1, 300, 4, 2, 64, 32), 100, 2, None, "float32"),  # 150 compressed rows: 2 key tiles
    "G3-w1-bs8-B2": ((2, 130, 3, 1, 32, 32), 1, 8, None, "float32"),
    "G16-w>T-varlen": ((1, 200, 16, 1, 128, 128), 1000, 32, CU, "float32"),
    "G1-bf16": ((1, 256, 4, 4, 128, 64), 64, 64, None, "bfloat16"),
}


def _branches(q, k, v, T, window_size, block_size, cu, kv_lens):
    """(name, keys, values, lo, hi, key_span, query_span, the public op on f32 inputs with the xla
    implementation) of the window and the compressed branch."""
    k_cmp, v_cmp = (nsa.compress(x, block_size=block_size, cu_seqlens=cu) for x in (k, v))
    kw = dict(cu_seqlens=cu, kv_lens=kv_lens, implementation="xla")
    window = lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=window_size, **kw)
    compressed = lambda q, k, v: nsa.compressed_attention(q, k, v, block_size=block_size, **kw)
    NC = k_cmp.shape[1]
    return [("window", k, v, *window_key_range(T, window_size, cu, kv_lens), window_size, window_size, window),
            ("compressed", k_cmp, v_cmp, *compressed_key_range(T, NC, block_size, cu, kv_lens), NC, T, compressed)]


def _finite(x):
    """x with its NaN (a cache's rows past its sequences) as 0."""
    return jnp.where(jnp.isnan(x), 0, x)


def _assert_matches_reference(q, k, v, do, window_size, block_size, cu, kv_lens=None):
    """Both branches' o, lse and gradients (dq, dk, dv; with a cotangent on lse) of the kernels in interpret
    mode equal the reference's; returns the kernels' gradients by branch name."""
    dtype = q.dtype.name
    T, Dk = q.shape[1], q.shape[3]
    f32 = lambda x: x.astype(jnp.float32)
    scale = Dk ** -0.5
    kernel_grads = {}
    for name, keys, values, lo, hi, key_span, query_span, reference in _branches(q, k, v, T, window_size,
                                                                                  block_size, cu, kv_lens):
        run = functools.partial(_flash.attend, scale=scale, key_span=key_span, interpret=INTERPRET)
        o, lse = jax.jit(lambda q, k, v: run(q, k, v, lo, hi))(q, keys, values)
        out_ref, vjp = jax.vjp(reference, f32(q), f32(keys), f32(values))
        o_ref, lse_ref = out_ref if name == "compressed" else (out_ref, None)
        assert o.dtype == q.dtype and o.shape == o_ref.shape and lse.dtype == jnp.float32
        assert_close(o, o_ref, TOLERANCE[dtype], f"{name} o")
        if lse_ref is not None:
            lse_np, lse_ref_np = np.asarray(lse), np.asarray(lse_ref)
            np.testing.assert_array_equal(np.isneginf(lse_np), np.isneginf(lse_ref_np))
            seen = np.isfinite(lse_ref_np)
            assert_close(lse_np[seen], lse_ref_np[seen], TOLERANCE[dtype], f"{name} lse")
        # gradients, with a cotangent on lse where it is finite (compressed)
        dlse = jnp.where(jnp.isfinite(lse), jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape), 0.0)
        backward = functools.partial(_flash.attend_backward, scale=scale, key_span=key_span, query_span=query_span,
                                     interpret=INTERPRET)
        grads = jax.jit(lambda q, k, v, o, lse, do, dlse: backward(
            q, k, v, lo, hi, o, lse, do, dlse if name == "compressed" else None))(q, keys, values, o, lse, do, dlse)
        grads_ref = vjp((f32(do), dlse) if name == "compressed" else f32(do))
        for g_name, g, g_ref, x, size in zip(("dq", "dk", "dv"), grads, grads_ref, (q, keys, values),
                                             gradient_scales(q, _finite(keys), _finite(values), do, scale)):
            assert g.dtype == x.dtype and g.shape == x.shape, g_name
            assert_close(g, g_ref, GRAD_TOLERANCE[dtype], f"{name} {g_name}", size)
        kernel_grads[name] = grads
    return kernel_grads


@pytest.mark.parametrize("shape, window_size, block_size, cu, dtype", CASES.values(), ids=CASES.keys())
def test_matches_the_reference_in_interpret_mode(shape, window_size, block_size, cu, dtype, pallas_races):
    B, T, HQ, H, Dk, Dv = shape
    q, k, v, do = _inputs(B, T, HQ, H, Dk, Dv, dtype)
    _assert_matches_reference(q, k, v, do, window_size, block_size, None if cu is None else jnp.asarray(cu))


def test_a_kv_cache(pallas_races):
    """The last 150 queries of sequences of 300 and 171 tokens in a 300-row cache (kv_lens): ranges per batch
    row over 2 query tiles and 3 key tiles (the window's; 150 compressed rows at block 2: 2 key tiles), the
    keys past each length NaN (also in the last, incomplete compressed block of 171): o, lse and the
    gradients equal the reference's with the same kv_lens, and those keys' dk and dv are zero."""
    lens = np.array([300, 171], np.int32)
    q, _, _, do = _inputs(2, 150, 4, 2, 32, 16, "float32")
    _, k, v, _ = _inputs(2, 300, 4, 2, 32, 16, "float32")
    past = (np.arange(300)[None, :] >= lens[:, None])[..., None, None]
    k, v = (jnp.where(past, jnp.nan, x) for x in (k, v))
    grads = _assert_matches_reference(q, k, v, do, 100, 2, None, jnp.asarray(lens))
    for g in grads["window"][1:]:
        assert np.all(np.asarray(g)[np.broadcast_to(past, g.shape)] == 0)


@pytest.mark.parametrize("shape, dtype", [((1, 8192, 64, 4, 128, 128), jnp.bfloat16),  # the standard shape
                                          ((1, 1000, 6, 2, 64, 48), jnp.float32)],  # G = 3, Dv != Dk
                         ids=["standard-bf16", "odd-f32"])
def test_lowers_for_tpu(shape, dtype):
    """jax.export for TPU lowers the kernels through Mosaic (tpu_custom_calls: the forward, then dq and
    dk/dv), window and compressed."""
    B, T, HQ, H, Dk, Dv = shape
    NC = -(-T // 64)
    for NK, (lo, hi), key_span, query_span in [(T, window_key_range(T, 512), 512, 512),
                                               (NC, compressed_key_range(T, NC, 64), NC, T)]:
        def forward_backward(q, k, v, do):
            o, lse = _flash.attend(q, k, v, lo, hi, scale=0.1, key_span=key_span)
            return _flash.attend_backward(q, k, v, lo, hi, o, lse, do, lse, scale=0.1, key_span=key_span,
                                          query_span=query_span)

        shapes = ((B, T, HQ, Dk), (B, NK, H, Dk), (B, NK, H, Dv), (B, T, HQ, Dv))
        args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
        module = jax.export.export(jax.jit(forward_backward), platforms=["tpu"])(*args).mlir_module()
        assert module.count("tpu_custom_call") == 3


@pytest.mark.parametrize("dk, dv, itemsize", [(128, 128, 2), (256, 256, 4), (16, 256, 4)])
def test_vmem_budget(dk, dv, itemsize):
    """Every block double-buffered plus the scratch, up to the widest heads of the contract (256) in
    float32: within the 16 MiB of scoped VMEM that Mosaic gives a kernel by default on v5e, v5p and v6e
    (whose VMEM is 64 to 128 MiB)."""
    assert _flash.vmem_bytes(dk, dv, itemsize) <= 16 * 2 ** 20


def test_config_is_checked():
    """A Config is checked when made, naming the field; the default tiles are 128 x 128 at every shape."""
    with pytest.raises(ValueError, match=r"Config.block_q: expected a multiple of the sublanes \(8\), got 100"):
        _flash.Config(block_q=100)
    with pytest.raises(ValueError, match=r"Config.block_k: expected a multiple of the lanes \(128\)"):
        _flash.Config(block_k=64)
    shapes = nsa._config.Shapes(1, 300, 300, 4, 2, 64, 32)
    assert _flash.default_config(shapes, jnp.float32, nsa._device.facts("tpu")) == _flash.Config(128, 128)
