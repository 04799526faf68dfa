"""The Triton kernels of selected attention (nsa/triton/selected.py): what the shared test base does not
reach.

On the CPU (every test but the gpu-marked one) the kernels run in Triton's interpreter
(nsa/triton/interpreter.py; the base runs there too, tests/test_triton_interpreted.py) against the XLA
reference on float32 copies of the same rounded inputs: lse (which the public op does not return), a
block in two chunks (D = 256), traced cu_seqlens, keys that must never be read, rows that see nothing,
tiles of several tokens sharing blocks, query lists split into many segments, bitwise determinism, and
one-token programs (G = 16) on queries at the end of a KV cache.
bfloat16 and wide heads run on the GPU (here, and the whole base in tests/test_triton_gpu.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa._config import Shapes
from nsa._device import TABLE
from nsa._varlen import tokens
from nsa.reference import selected as reference
from tests.base import GRAD_TOLERANCE, TOLERANCE, Inputs, assert_close, gradient_scales
from tests.conftest import ON_GPU

pytestmark = pytest.mark.interpreted  # the kernels in Triton's interpreter (their gpu tests: pytest -m gpu)

# (B, T, HQ, H, Dk, Dv, block_size)
CASES = {
    "G3-T40-fp16": ((1, 40, 3, 1, 32, 16, 16), "float16", "array", None),
    "D256-chunked": ((1, 40, 2, 1, 256, 200, 64), "float32", "all", None),  # the block in 2 chunks of 32
}


def _counts(kind, B, T, H):
    return {"all": None, "int": 3,
            "array": np.random.default_rng(2).integers(0, 6, (B, T, H)).astype(np.int32)}[kind]


def _sizes(x):
    """The natural size of o (0: its own RMS; o is never a cancellation), dq, dk and dv on the inputs x."""
    return [0.0] + gradient_scales(x.q, x.k, x.v, x.do, x.shape[4] ** -0.5)


def _f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def _run(impl, q, k, v, do, idx, counts, bs, cu, jit=False, kv_lens=None):
    """o and (dq, dk, dv) of the public op with `impl`."""
    f = lambda q, k, v, cu: nsa.selected_attention(q, k, v, idx, block_counts=counts, block_size=bs,
                                                   cu_seqlens=cu, kv_lens=kv_lens, implementation=impl)

    def run(q, k, v, do, cu):
        o, vjp = jax.vjp(lambda q, k, v: f(q, k, v, cu), q, k, v)
        return o, vjp(do)

    return (jax.jit(run) if jit else run)(q, k, v, do, cu)


def _direct_lse(q, k, v, idx, counts, bs, cu, scale):
    """lse from the kernel's forward, and in float64 NumPy from the reference's key selection."""
    B, T, HQ, H = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    counts = jnp.broadcast_to(jnp.asarray(idx.shape[-1] if counts is None else counts, jnp.int32), (B, T, H))
    from nsa.triton import selected as kernels
    got = kernels.forward(q, k, v, jnp.asarray(idx), counts, None if cu is None else jnp.asarray(cu),
                          block_size=bs, scale=scale)[1][-1]
    tok = tokens(T, bs, None if cu is None else jnp.asarray(cu))
    keys, attended = (np.asarray(a) for a in reference.selected_keys(jnp.asarray(idx), counts, tok.pos, tok.start,
                                                                   block_size=bs))
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k_sel = k64[np.arange(B)[:, None, None, None], keys, np.arange(H)[None, None, :, None]]  # [B, T, H, K, D]
    s = scale * np.einsum("bthgd,bthkd->bthgk", q64.reshape(B, T, H, HQ // H, -1), k_sel)
    s = np.where(attended[:, :, :, None], s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = np.squeeze(m, -1) + np.log(np.sum(np.exp(s - np.where(np.isfinite(m), m, 0)), -1))
    lse = np.where(attended.any(-1)[:, :, :, None], lse, -np.inf)
    return np.asarray(got), lse.reshape(B, T, HQ)


@pytest.mark.parametrize("shape, dtype, counts, cu", CASES.values(), ids=CASES.keys())
def test_forward_and_gradients_match_reference(interpreted, shape, dtype, counts, cu):
    x = Inputs(shape, dtype)
    B, T, _, H, Dk = shape[:5]
    bs = x.block_size
    idx = x.block_indices(4)  # -1, beyond t // bs, 2^30 and repeated entries
    counts = _counts(counts, B, T, H)
    o, grads = _run("triton", x.q, x.k, x.v, x.do, idx, counts, bs, cu)
    o_ref, grads_ref = _run("xla", *_f32(x.q, x.k, x.v, x.do), idx, counts, bs, cu)
    assert o.dtype == x.q.dtype
    assert_close(o, o_ref, TOLERANCE[dtype], "o")
    for name, g, g_ref, arg, size in zip(("dq", "dk", "dv"), grads, grads_ref, (x.q, x.k, x.v), _sizes(x)[1:]):
        assert g.dtype == arg.dtype, name
        assert_close(g, g_ref, GRAD_TOLERANCE[dtype], name, size)

    lse, lse_ref = _direct_lse(x.q, x.k, x.v, idx, counts, bs, cu, Dk ** -0.5)
    assert lse.dtype == np.float32 and lse.shape == (B, T, shape[2])
    np.testing.assert_array_equal(lse == -np.inf, lse_ref == -np.inf)
    seen = np.isfinite(lse_ref)
    assert_close(lse[seen], lse_ref[seen], TOLERANCE[dtype], "lse")


def test_backward_computes_the_gradients_asked_for(interpreted):
    """backward(grads=(0,)) computes dq alone and grads=(1, 2) dk and dv alone (None in the others' places), each
    the bits of the whole backward's: implementation=None takes dq from Mosaic GPU's kernel where it claims it."""
    from nsa.triton import selected as kernels
    x = Inputs((1, 40, 3, 1, 32, 16, 16), "float32")
    idx = jnp.asarray(x.block_indices(4))
    counts = jnp.full(idx.shape[:3], 4, jnp.int32)
    _, residuals = kernels.forward(x.q, x.k, x.v, idx, counts, None, block_size=16, scale=0.25)
    backward = lambda grads: kernels.backward(residuals, x.do, block_size=16, scale=0.25, grads=grads)
    whole, dq, dkdv = backward(None), backward((0,)), backward((1, 2))
    assert dq[1:] == (None,) * 6 and dkdv[0] is None and dkdv[3:] == (None,) * 4
    for got, want in zip((dq[0], *dkdv[1:3]), whole[:3]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_varlen_traced_cu_seqlens_and_bitwise_repeatable(interpreted):
    """Under jit cu_seqlens is traced (block rows padded to a static bound); two runs are bitwise equal."""
    cu = np.array([0, 13, 13, 40, 60], np.int32)  # an empty sequence, partial blocks
    x = Inputs((1, 60, 2, 1, 16, 16, 16), "float32")
    idx = x.block_indices(4)
    first = _run("triton", x.q, x.k, x.v, x.do, idx, None, 16, cu, jit=True)
    second = _run("triton", x.q, x.k, x.v, x.do, idx, None, 16, cu, jit=True)
    ref = _run("xla", x.q, x.k, x.v, x.do, idx, None, 16, cu)
    for a, b, c, size in zip(*(jax.tree_util.tree_leaves(r) for r in (first, second, ref)), _sizes(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_close(a, c, 1e-5, "traced cu_seqlens", size)


def test_invalid_entries_are_never_read(interpreted):
    """Keys and values of the last block are NaN; no query may read them: as -1, as a future block, as a
    slot past block_counts. Every output and gradient is finite and equals the reference's on zeros."""
    B, T, HQ, H, D, bs = 1, 48, 3, 1, 16, 16
    x = Inputs((B, T, HQ, H, D, D, bs), "float32")
    t = np.arange(T)
    future = np.stack([t // bs, np.full(T, 2), np.full(T, -1), np.full(T, 2 ** 30)], -1)  # 2 > t // bs: invalid
    last = np.stack([np.zeros(T), np.ones(T), np.full(T, 2), np.full(T, 2)], -1)  # slots 2, 3 past the count
    idx = np.where((t < 2 * bs)[:, None], future, last).astype(np.int32)[None, :, None, :]
    counts = np.where(t < 2 * bs, 4, 2).astype(np.int32)[None, :, None]
    poison = (t >= 2 * bs)[None, :, None, None]
    k_nan, v_nan = jnp.where(poison, jnp.nan, x.k), jnp.where(poison, jnp.nan, x.v)
    k_zero, v_zero = jnp.where(poison, 0.0, x.k), jnp.where(poison, 0.0, x.v)
    o, (dq, dk, dv) = _run("triton", x.q, k_nan, v_nan, x.do, idx, counts, bs, None)
    o_ref, (dq_ref, dk_ref, dv_ref) = _run("xla", x.q, k_zero, v_zero, x.do, idx, counts, bs, None)
    sizes = _sizes(x)
    for name, a, b, size in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (o_ref, dq_ref, dk_ref, dv_ref), sizes):
        assert_close(a, b, 1e-5, name, size)
    assert np.all(np.asarray(dk)[:, 2 * bs:] == 0) and np.all(np.asarray(dv)[:, 2 * bs:] == 0)


def test_rows_that_see_nothing(interpreted):
    """A row with nothing visible: o = 0, lse = -inf, zero dq, and no NaN anywhere; a whole call that
    sees nothing gives zero dk and dv."""
    B, T, HQ, H, D, bs = 1, 32, 3, 1, 16, 16
    x = Inputs((B, T, HQ, H, D, 32, bs), "float32")
    t = np.arange(T)[None, :, None, None]
    idx = np.broadcast_to(np.where(t % 2 == 0, -1, t // bs), (B, T, H, 2)).astype(np.int32)
    blind = (np.arange(T) % 2 == 0)
    o, (dq, dk, dv) = _run("triton", x.q, x.k, x.v, x.do, idx, None, bs, None)
    o_ref, grads_ref = _run("xla", x.q, x.k, x.v, x.do, idx, None, bs, None)
    assert np.all(np.asarray(o)[:, blind] == 0) and np.all(np.asarray(dq)[:, blind] == 0)
    for a, b, size in zip((o, dq, dk, dv), (o_ref, *grads_ref), _sizes(x)):
        assert_close(a, b, 1e-5, "partly blind", size)
    lse, _ = _direct_lse(x.q, x.k, x.v, idx, None, bs, None, D ** -0.5)
    assert np.all(lse[:, blind] == -np.inf) and np.all(np.isfinite(lse[:, ~blind]))

    none = np.full((B, T, H, 2), -1, np.int32)
    o, grads = _run("triton", x.q, x.k, x.v, x.do, none, np.zeros((B, T, H), np.int32) + 2, bs, None)
    assert np.all(np.asarray(o) == 0)
    for g in grads:
        assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("shape, cu", [
    ((1, 40, 2, 2, 16, 24, 8), np.array([0, 7, 7, 29, 40], np.int32)),  # G = 1: tiles of 16 tokens
    ((1, 40, 3, 1, 16, 16, 8), np.array([0, 7, 7, 29, 40], np.int32)),  # G = 3: tiles of 4 tokens
    ((1, 16, 16, 1, 16, 16, 8), np.array([0, 5, 5, 16], np.int32)),  # G = 16: one token, the slot loop
], ids=["G1-packed", "G3-packed", "G16-packed"])
def test_tokens_of_a_tile_share_blocks(interpreted, shape, cu):
    """Small groups put several tokens in one program (16 rows: 16 tokens at G = 1, 4 at G = 3) and walk the
    distinct blocks they list. Neighbouring tokens list the same blocks (block 0 and their own block, the
    latter twice: weight 2), besides -1, future and far out-of-range entries and counts from 0 to S; packed
    sequence boundaries (one followed by an empty sequence) fall inside tiles, so one tile holds tokens of
    different sequences whose in-sequence block ids coincide. G = 16 runs such selections through the
    one-token slot loop. o, lse, dq, dk and dv against the reference, and two jitted runs
    bitwise equal."""
    x = Inputs(shape, "float32")
    B, T, _, H = shape[:4]
    bs, scale = x.block_size, shape[4] ** -0.5
    cur = np.asarray(tokens(T, bs, jnp.asarray(cu)).pos[0]) // bs  # in-sequence block of each token
    rng = np.random.default_rng(5)
    rand = rng.integers(-1, cur + 2, (B, H, T))  # -1, a visible block or the next one (invalid)
    far = np.where(np.arange(T) % 3 == 0, 2 ** 30, rng.integers(0, cur + 1, (B, H, T)))
    idx = np.stack(np.broadcast_arrays(0 * cur, cur, cur, rand, far), -1).transpose(0, 2, 1, 3).astype(np.int32)
    counts = rng.integers(0, 6, (B, T, H)).astype(np.int32)
    counts[:, :4] = 5  # the first four tokens use every slot
    first, second = (_run("triton", x.q, x.k, x.v, x.do, idx, counts, bs, cu, jit=True) for _ in range(2))
    ref = _run("xla", x.q, x.k, x.v, x.do, idx, counts, bs, cu, jit=True)
    leaves = (jax.tree_util.tree_leaves(r) for r in (first, second, ref))
    for name, a, b, c, size in zip(("o", "dq", "dk", "dv"), *leaves, _sizes(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)
        assert_close(a, c, GRAD_TOLERANCE["float32"], name, size)

    lse, lse_ref = _direct_lse(x.q, x.k, x.v, idx, counts, bs, cu, scale)
    np.testing.assert_array_equal(lse == -np.inf, lse_ref == -np.inf)
    assert np.any(lse == -np.inf) and np.any(np.isfinite(lse))
    seen = np.isfinite(lse_ref)
    assert_close(lse[seen], lse_ref[seen], TOLERANCE["float32"], "lse")


@pytest.mark.parametrize("tq", [1, 13], ids=["decode", "chunk"])
def test_cached_queries_one_token_per_program(interpreted, tq):
    """G = 16 runs one token per program (the slot loop, forward and dq) on the last tq tokens of sequences of
    45 and 30 tokens in a cache of 48 (keys past each length NaN: never read), with -1, future, far and
    repeated entries and counts from 0 to S: o, dq, dk and dv against the reference on zeros past each
    length, and zero dk / dv there."""
    x = Inputs((2, 48, 16, 1, 16, 16, 8), "float32")
    lens = np.array([45, 30], np.int32)
    last = lambda y: np.stack([np.asarray(y)[b, n - tq:n] for b, n in enumerate(lens)])  # [B, tq, ...]
    past = np.arange(48)[None, :, None, None] >= lens[:, None, None, None]
    idx = last(x.block_indices(4))
    counts = last(_counts("array", 2, 48, 1))
    q, do, kv_lens = last(x.q), last(x.do), jnp.asarray(lens)
    o, grads = _run("triton", q, jnp.where(past, jnp.nan, x.k), jnp.where(past, jnp.nan, x.v), do, idx, counts,
                    x.block_size, None, kv_lens=kv_lens)
    zero_k, zero_v = jnp.where(past, 0.0, x.k), jnp.where(past, 0.0, x.v)
    o_ref, grads_ref = _run("xla", q, zero_k, zero_v, do, idx, counts, x.block_size, None, kv_lens=kv_lens)
    sizes = [0.0] + gradient_scales(q, zero_k, zero_v, do, x.shape[4] ** -0.5)
    for name, a, b, size in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref), sizes):
        assert_close(a, b, 1e-5, name, size)
    for g in grads[1:]:
        assert not np.any(np.asarray(g)[np.broadcast_to(past, g.shape)])


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 300, 6, 1, 256, 128, 64), (2, 200, 16, 2, 192, 64, 128),
                                   (1, 129, 1, 1, 64, 256, 16)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wide_heads_on_gpu(shape, dtype):
    """Dk, Dv up to 256, block_size up to 128, G = 6 and 16, against the float32 reference."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU and jax-triton")
    x = Inputs(shape, dtype)
    B, T, _, H = shape[:4]
    idx = x.block_indices(8)
    counts = _counts("array", B, T, H)
    o, grads = _run("triton", x.q, x.k, x.v, x.do, idx, counts, x.block_size, None)
    o_ref, grads_ref = _run("xla", *_f32(x.q, x.k, x.v, x.do), idx, counts, x.block_size, None)
    assert_close(o, o_ref, TOLERANCE[dtype], "o")
    for name, g, g_ref, size in zip(("dq", "dk", "dv"), grads, grads_ref, _sizes(x)[1:]):
        assert_close(g, g_ref, GRAD_TOLERANCE[dtype], name, size)


def test_vmap_runs_the_kernel_per_mapped_element(interpreted):
    """triton_call has no batching rule: the dispatcher's lax.map rule gives vmap (and its gradient)."""
    x = [Inputs((1, 24, 2, 1, 16, 16, 8), "float32", seed=s) for s in range(2)]
    idx = x[0].block_indices(3)
    f = lambda q, k, v: nsa.selected_attention(q, k, v, idx, block_size=8, implementation="triton")
    q, k, v = (jnp.stack([getattr(xi, n) for xi in x]) for n in "qkv")
    o = jax.vmap(f)(q, k, v)
    dq = jax.grad(lambda q: jnp.sum(jax.vmap(f)(q, k, v) ** 2))(q)
    for i, xi in enumerate(x):
        np.testing.assert_array_equal(np.asarray(o[i]), np.asarray(f(xi.q, xi.k, xi.v)))
        dq_i = jax.grad(lambda q: jnp.sum(f(q, xi.k, xi.v) ** 2))(xi.q)
        assert_close(dq[i], dq_i, 1e-6, "dq under vmap")


@pytest.mark.parametrize("shape, seg_len, cu", [
    ((2, 32, 6, 2, 16, 24, 16), 24, None),  # G = 3: steps of 16 queries, 16 then 8 per segment; b, h > 0
    ((1, 60, 2, 1, 16, 16, 16), 5, np.array([0, 13, 13, 40, 60], np.int32)),  # packed, traced under jit
], ids=["split-by-24", "varlen-split-by-5"])
def test_long_lists_split_into_segments(interpreted, shape, seg_len, cu):
    """Lists cut into many segments (a Config with a small L) where block 0 is selected by every token, the
    current block twice (so block 0 up to three times) and a random one: the backward (jitted, so a
    cu_seqlens is traced) against the reference's gradients, and bitwise repeatable."""
    from nsa.triton import selected as kernels

    x = Inputs(shape, "float32")
    B, T, _, H = shape[:4]
    bs, scale = x.block_size, shape[4] ** -0.5
    cu_j = None if cu is None else jnp.asarray(cu)
    cur = np.asarray(tokens(T, bs, cu_j).pos[0]) // bs  # in-sequence block of each token
    rand = np.random.default_rng(3).integers(-1, cur + 2)  # -1, a visible block or the next (invalid)
    idx = np.broadcast_to(np.stack([0 * cur, cur, cur, rand], -1)[None, :, None], (B, T, H, 4)).astype(np.int32)
    counts = jnp.full((B, T, H), 4, jnp.int32)
    shapes = Shapes.of(x.q, x.k, x.v, block_size=bs, block_counts=idx.shape[-1], packed=cu is not None)
    config = kernels.default_config(shapes, x.q.dtype, TABLE["NVIDIA H200"])._replace(segment=seg_len)
    _, res = kernels.forward(x.q, x.k, x.v, jnp.asarray(idx), counts, cu_j, block_size=bs, scale=scale)
    backward = jax.jit(lambda res, do: kernels.backward(res, do, block_size=bs, scale=scale, config=config)[:3])
    first, second = backward(res, x.do), backward(res, x.do)
    _, ref = _run("xla", x.q, x.k, x.v, x.do, idx, None, bs, cu)
    for name, a, b, c, size in zip(("dq", "dk", "dv"), first, second, ref, _sizes(x)[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_close(a, c, 1e-5, name, size)
