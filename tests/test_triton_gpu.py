"""The shared test base on the GPU kernels (implementation="triton"), and what only a GPU can show.

Run on an NVIDIA GPU with jax-triton installed: `scripts/gpu.sh tests` (pytest -m gpu). On the CPU
`make test` deselects it (-m "not gpu"); the kernel bodies are tested there in Triton's interpreter
by tests/test_triton_*.py.
"""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa import _dispatch
from nsa.triton._launch import jax_triton_error
from tests.base import GRAD_TOLERANCE, MOSAIC_GPU_LOWERS, TOLERANCE, NSATestBase, assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU and jax-triton")


class TestTriton(NSATestBase):
    implementation = "triton"
    dtypes = ("float32", "bfloat16", "float16")
    exhaustive = True


def test_default_implementation_on_gpu_runs_the_kernels():
    """implementation=None lowers to the Triton kernels on a GPU (the Mosaic GPU select where this jax lowers it):
    the same bits as "triton", here on selections whose tiles share few blocks (every token its own)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 300, 16, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 300, 1, 64)), jnp.bfloat16) for _ in range(2))
    run = lambda impl: jax.jit(lambda q, k, v: nsa.attention(q, k, v, g_cmp=q[..., 0], block_counts=4, block_size=32,
                                                             window_size=64, implementation=impl))(q, k, v)
    got, want = (np.asarray(run(impl), np.float32) for impl in (None, "triton"))
    if MOSAIC_GPU_LOWERS:  # selected attention's forward may run on Mosaic GPU (next test)
        assert_close(got, want, TOLERANCE["bfloat16"], "o")
    else:
        np.testing.assert_array_equal(got, want)
    q, k, v, idx = _selection(own=True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), *(_forward_and_gradients(q, k, v, idx, impl)
                                                     for impl in (None, "triton"))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def _selection(own):
    """q [1, 512, 32, 64], k, v [1, 512, 2, 64] bfloat16 and block_indices [1, 512, 2, 4] (block 16): each of the 4
    tokens of a tile (G = 16) selects 4 blocks of its own (own), or all select the same 4 (blocks 0-3, or fewer
    where causality cuts them)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 512, 32, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 512, 2, 64)), jnp.bfloat16) for _ in range(2))
    t, s = np.arange(512)[:, None], np.arange(4)[None]
    idx = (t % 4) * 4 + s if own else np.broadcast_to(s, (512, 4))
    return q, k, v, jnp.asarray(np.broadcast_to(idx[None, :, None], (1, 512, 2, 4)), jnp.int32)


def _forward_and_gradients(q, k, v, idx, impl):
    """o and (dq, dk, dv) of selected attention (block 16) with `impl`, under jit; the cotangent o (no second
    random stream)."""
    def run(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: nsa.selected_attention(q, k, v, idx, block_size=16, implementation=impl),
                         q, k, v)
        return (o,) + vjp(o)

    return jax.jit(run)(q, k, v)


@pytest.mark.skipif(not MOSAIC_GPU_LOWERS, reason="Mosaic GPU lowers its kernels from jax 0.11 on")
def test_default_runs_the_mosaic_gpu_forward_and_dq_where_tiles_share_blocks(monkeypatch):
    """Where the tokens of each tile select the same blocks, implementation=None runs selected attention's forward
    and dq on Mosaic GPU (nsa.pallas.gpu.selected.packs and packs_dq: the same bits as "pallas" for o), and dk and
    dv on Triton over the Mosaic GPU forward's residuals: all agree with the reference.

    The dq claim holds from MIN_DQ_TOKENS tokens on, lowered here to these 512 (the test holds: packs_dq). On
    these inputs Triton's and Mosaic GPU's dq kernels give the same bits, and their dk and dv differ by 2e-4 and
    4e-4 of their RMS, as much as XLA's delta = sum(o * do), fused into each program its own way, moves them: the
    gradients are compared with the reference's, not to tell the kernels apart (the choice itself:
    tests/test_house.py, with two families that tell)."""
    from nsa.pallas.gpu import selected as mosaic
    monkeypatch.setattr(mosaic, "MIN_DQ_TOKENS", 512)
    jax.clear_caches()  # no backward traced under the default MIN_DQ_TOKENS is reused
    q, k, v, idx = _selection(own=False)
    counts = jnp.full(idx.shape[:3], 4, jnp.int32)
    o, residuals = jax.jit(lambda: mosaic.forward(q, k, v, idx, counts, None, block_size=16, scale=64 ** -0.5))()
    assert bool(jax.jit(lambda: mosaic.packs_dq(residuals, o, block_size=16, scale=64 ** -0.5))())
    got, pallas, ref = (_forward_and_gradients(q, k, v, idx, impl) for impl in (None, "pallas", "xla"))
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(pallas[0], np.float32))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        tol = (TOLERANCE if name == "o" else GRAD_TOLERANCE)["bfloat16"]
        assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), tol, name)


@pytest.mark.parametrize("compression", [(64, 64), (32, 16)], ids=["one-row-per-block", "eq9"])
def test_default_select_is_triton_where_blocks_sum_eq9(compression):
    """implementation=None's block selection on CUDA: Mosaic GPU's (where this jax lowers it) where each block is
    one compressed row, Triton's alone where a block sums several rows (Eq. 9: the Triton family's claim,
    nsa.triton.select.sums_eq9), with no cond between them; the blocks are those of the family that ran."""
    l, d = compression
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1024, 16, 64)), jnp.bfloat16)
    k_cmp = nsa.compress(jnp.asarray(rng.standard_normal((1, 1024, 1, 64)), jnp.bfloat16), block_size=l, stride=d)
    select = lambda impl: jax.jit(lambda q, k_cmp: nsa.select_blocks(
        q, k_cmp, block_counts=8, block_size=64, compress_block_size=l, compress_stride=d, implementation=impl))
    family = "pallas" if MOSAIC_GPU_LOWERS and compression == (64, 64) else "triton"
    text = select(None).lower(q, k_cmp).as_text()
    assert ("triton_kernel_call" in text, "mosaic_gpu" in text) == (family == "triton", family == "pallas")
    np.testing.assert_array_equal(select(None)(q, k_cmp), select(family)(q, k_cmp))


@pytest.mark.skipif(not MOSAIC_GPU_LOWERS, reason="Mosaic GPU lowers its kernels from jax 0.11 on")
@pytest.mark.parametrize("tokens", [512, 256], ids=["claimed", "at-the-bound"])
def test_default_runs_the_mosaic_gpu_window_backward_on_shorter_calls(monkeypatch, tokens):
    """implementation=None runs the window's forward on Triton and, on calls of fewer than BACKWARD_TOKENS tokens
    (lowered here to `tokens`), its backward on Mosaic GPU over Triton's residuals (nsa.pallas.gpu.window
    .outruns_backward), Triton's at the bound and past it: o has Triton's bits, the gradients agree with the
    reference's (G = 3, packed sequences)."""
    from nsa.pallas.gpu import window as mosaic
    monkeypatch.setattr(mosaic, "BACKWARD_TOKENS", tokens)
    jax.clear_caches()  # no backward traced under the default bound is reused
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 256, 6, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.bfloat16) for _ in range(2))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    cu = jnp.array([0, 100, 256], jnp.int32)

    def run(impl):
        o, vjp = jax.vjp(lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=48, cu_seqlens=cu,
                                                                      implementation=impl), q, k, v)
        return (o,) + vjp(do)

    text = jax.jit(run, static_argnums=0).lower(None).as_text()
    assert ("mosaic_gpu" in text) == (tokens > 256) and "triton_kernel_call" in text
    got, triton, ref = (jax.jit(run, static_argnums=0)(impl) for impl in (None, "triton", "xla"))
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(triton[0], np.float32))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        tol = (TOLERANCE if name == "o" else GRAD_TOLERANCE)["bfloat16"]
        assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), tol, name)


def test_long_sequence_needs_64_bit_offsets():
    long_sequence_check("triton")


def long_sequence_check(impl):
    """T = 131072, HQ = 64, D = 128 and B = 2: B * T * HQ * D = 2^31 elements, past int32 offsets.

    Every kernel runs on the whole batch; the second row's last 4096 queries are compared with the
    reference run on that row alone (selection: the same blocks in at least 99% of the rows; each
    branch's output given the reference's selection)."""
    B, T, HQ, H, D, bs, tail = 2, 131072, 64, 4, 128, 64, 4096
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.bfloat16)

    def branches(q, k, v, idx, impl):
        k_cmp, v_cmp = nsa.compress(k, block_size=bs), nsa.compress(v, block_size=bs)
        chosen = nsa.select_blocks(q, k_cmp, block_counts=16, block_size=bs, implementation=impl)
        o_cmp, lse = nsa.compressed_attention(q, k_cmp, v_cmp, block_size=bs, implementation=impl)
        o_slc = nsa.selected_attention(q, k, v, idx, block_size=bs, implementation=impl)
        o_swa = nsa.sliding_window_attention(q, k, v, window_size=512, implementation=impl)
        return chosen[:, -tail:], o_cmp[:, -tail:], lse[:, -tail:], o_slc[:, -tail:], o_swa[:, -tail:]

    ref_idx = jax.jit(lambda q, k: nsa.select_blocks(q, nsa.compress(k, block_size=bs), block_counts=16,
                                                     block_size=bs, implementation="xla"))(q[1:], k[1:])
    idx = jnp.concatenate([ref_idx, ref_idx], 0)  # row 0 reuses row 1's selection: any valid one will do
    got = jax.jit(lambda q, k, v, idx: branches(q, k, v, idx, impl))(q, k, v, idx)
    ref = jax.jit(lambda q, k, v, idx: branches(q, k, v, idx, "xla"))(q[1:], k[1:], v[1:], ref_idx)
    same = np.all(np.sort(np.asarray(got[0][1]), -1) == np.sort(np.asarray(ref[0][0]), -1), -1)
    assert same.mean() >= 0.99, f"{1 - same.mean():.2%} of the selections differ"
    for name, a, b in zip(["o_cmp", "lse", "o_slc", "o_swa"], got[1:], ref[1:]):
        assert_close(np.asarray(a[1], np.float32), np.asarray(b[0], np.float32), 2 * TOLERANCE["bfloat16"], name)


def test_what_runs_where_on_gpu():
    select = "pallas" if MOSAIC_GPU_LOWERS else "triton"  # CUDA_PREFERENCE: select measured faster on Mosaic GPU
    assert nsa.implementations() == {"compress": "xla", "compressed_attention": "triton", "select_blocks": select,
                                     "selected_attention": "triton", "sliding_window_attention": "triton"}
    assert set(nsa.implementations(dtype=jnp.float64).values()) == {"xla"}


def test_explicit_triton_refuses_float64():
    with jax.enable_x64(True):
        q = jnp.zeros((1, 64, 4, 16), jnp.float64)
        k = jnp.zeros((1, 64, 2, 16), jnp.float64)
        with pytest.raises(TypeError, match="implementation='triton' cannot run sliding_window_attention on float64"):
            nsa.sliding_window_attention(q, k, k, window_size=8, implementation="triton")


def test_without_jax_triton_the_default_warns_once_and_runs_the_reference(monkeypatch):
    """A plain `pip install .` on a GPU machine: jax_triton does not import."""
    monkeypatch.setitem(sys.modules, "jax_triton", None)
    monkeypatch.setattr(_dispatch, "_warned", set())
    jax_triton_error.cache_clear()
    try:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, 128, 4, 32)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, 128, 2, 32)), jnp.float32)
        run = lambda impl: nsa.attention(q, k, k, block_counts=2, block_size=16, window_size=8, implementation=impl)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o, o2 = run(None), run(None)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "pip install '.[cuda]'" in messages[0], messages
        np.testing.assert_array_equal(np.asarray(o), np.asarray(run("xla")))
        assert set(nsa.implementations(dtype=jnp.float32).values()) == {"xla"}  # Mosaic GPU takes 16-bit inputs
        with pytest.raises(ValueError, match="jax-triton does not import"):
            run("triton")
    finally:
        jax_triton_error.cache_clear()
