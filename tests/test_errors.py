"""Every malformed call raises ValueError or TypeError at trace time, naming the argument, the
expected and the received shape, dtype or value."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa

B, T, HQ, H, D, BS = 1, 32, 4, 2, 8, 8
q = jnp.zeros((B, T, HQ, D))
k = jnp.zeros((B, T, H, D))
v = jnp.zeros((B, T, H, D))
k_cmp = jnp.zeros((B, T // BS, H, D))
g = jnp.zeros((B, T, HQ))
idx = jnp.zeros((B, T, H, 2), jnp.int32)
cu = jnp.array([0, 10, T], jnp.int32)

CASES = {
    # the shapes of q, k, v
    "HQ not a multiple of H": (lambda: nsa.attention(q, jnp.zeros((B, T, 3, D)), jnp.zeros((B, T, 3, D))),
                               ValueError, r"HQ \(q.shape\[2\] = 4\) must be a multiple of .*H \(k.shape\[2\] = 3\)"),
    "q rank": (lambda: nsa.attention(q[0], k, v), ValueError, r"q must have 4 dimensions, got shape \(32, 4, 8\)"),
    "B mismatch": (lambda: nsa.attention(q, jnp.zeros((2, T, H, D)), v), ValueError,
                   r"k must have shape \[B, TK, H, Dk\].*= \(1, 32, 2, 8\), got \(2, 32, 2, 8\)"),
    "T mismatch": (lambda: nsa.selected_attention(q, k, jnp.zeros((B, T + 1, H, D)), idx), ValueError,
                   r"v must have shape \[B, TK, H, Dv\].*= \(1, 32, 2, 8\), got \(1, 33, 2, 8\)"),
    "k shorter than q": (lambda: nsa.attention(q, k[:, :T - 1], v[:, :T - 1]), ValueError,
                         r"k must have at least as many tokens as q \(TK = k.shape\[1\] >= T = q.shape\[1\] = 32.*"
                         r"got shape \(1, 31, 2, 8\)"),
    # kv_lens and a KV cache's compressed keys
    "kv_lens below T": (lambda: nsa.attention(q[:, :4], k, v, kv_lens=jnp.array([3])), ValueError,
                        r"kv_lens must lie in \[T, TK = k.shape\[1\]\] = \[4, 32\].*got kv_lens\[0\] = 3"),
    "kv_lens above TK": (lambda: nsa.sliding_window_attention(q[:, :4], k, v, window_size=4, kv_lens=[33]),
                         ValueError, r"kv_lens must lie in \[T, TK = k.shape\[1\]\] = \[4, 32\].*kv_lens\[0\] = 33"),
    "kv_lens past k_cmp": (lambda: nsa.compressed_attention(q[:, :4], k_cmp, k_cmp, block_size=BS, kv_lens=[33]),
                           ValueError, r"kv_lens must lie in \[T, NC \* block_size, the tokens k_cmp covers\] = "
                                       r"\[4, 32\].*kv_lens\[0\] = 33"),
    "kv_lens shape": (lambda: nsa.attention(q, k, v, kv_lens=jnp.array([T, T])), ValueError,
                      r"kv_lens must have shape \[B\] = \(1,\), got \(2,\)"),
    "kv_lens float": (lambda: nsa.attention(q, k, v, kv_lens=jnp.array([32.0])), TypeError,
                      r"kv_lens must have an integer dtype, got float32"),
    "kv_lens with cu_seqlens": (lambda: nsa.attention(q, k, v, kv_lens=[T], cu_seqlens=cu), ValueError,
                                r"kv_lens .* and cu_seqlens .* cannot be given together"),
    "k_cmp too short (attention)": (lambda: nsa.attention(q, k, v, k_cmp=k_cmp[:, :3], block_size=BS), ValueError,
                                    r"k_cmp must have the rows compress\(k, block_size=8\) gives for k's TK = 32 "
                                    r"tokens, 4 \(NC, axis 1\), got shape \(1, 3, 2, 8\)"),
    # compression windows of l tokens every d, selection blocks of l': d divides l and l'
    "stride not dividing the window": (lambda: nsa.compress(k, block_size=BS, stride=3), ValueError,
                                       r"stride = 3 must divide block_size = 8: each compressed row is a window"),
    "compress_stride not dividing the window": (
        lambda: nsa.attention(q, k, v, block_size=BS, compress_block_size=12, compress_stride=8), ValueError,
        r"compress_stride = 8 must divide compress_block_size = 12"),
    "compress_stride not dividing the selection block": (
        lambda: nsa.select_blocks(q, k_cmp, block_counts=2, block_size=BS, compress_block_size=12,
                                  compress_stride=6), ValueError, r"compress_stride = 6 must divide block_size = 8"),
    "compress_stride not dividing the default block_size": (
        lambda: nsa.attention(q, k, v, compress_stride=48), ValueError,
        r"compress_stride = 48 must divide block_size = 64 \(its default\): a selection block is scored"),
    "k_cmp of windows that do not overlap, given to overlapping ones": (
        lambda: nsa.attention(q, k, v, g_cmp=g, k_cmp=k_cmp, v_cmp=k_cmp, block_size=BS, compress_stride=4),
        ValueError, r"compress\(k, block_size=8, stride=4\) gives for k's TK = 32 tokens, 8 \(NC, axis 1\), got "
                    r"shape \(1, 4, 2, 8\): compressed keys made with another block_size or stride"),
    "k_cmp of overlapping windows, given to a compressed attention without stride": (
        lambda: nsa.compressed_attention(q, *[nsa.compress(k, block_size=BS, stride=4)] * 2, block_size=BS),
        ValueError, r"gives for q's T = 32 tokens, 4 \(NC, axis 1\), got shape \(1, 8, 2, 8\)"),
    "kv_lens past overlapping k_cmp": (
        lambda: nsa.compressed_attention(q[:, :4], k_cmp, k_cmp, block_size=BS, stride=4, kv_lens=[17]),
        ValueError, r"kv_lens must lie in \[T, NC \* stride, the tokens k_cmp covers\] = \[4, 16\]"),
    # compressed keys of another block size (the rows of block 8 given to an attention of block 16, and back)
    "k_cmp of a smaller block": (lambda: nsa.attention(q, k, v, g_cmp=g, k_cmp=k_cmp, v_cmp=k_cmp, block_size=2 * BS),
                                 ValueError, r"gives for k's TK = 32 tokens, 2 \(NC, axis 1\), got shape \(1, 4, 2, 8\)"
                                             r": compressed keys made with another block_size or stride"),
    "k_cmp of a larger block": (lambda: nsa.attention(q, k, v, k_cmp=nsa.compress(k, block_size=2 * BS), block_size=BS),
                                ValueError, r"gives for k's TK = 32 tokens, 4 \(NC, axis 1\), got shape \(1, 2, 2, 8\)"),
    "k_cmp packed, another block": (lambda: nsa.attention(q, k, v, k_cmp=nsa.compress(k, block_size=BS, cu_seqlens=cu),
                                                          block_size=2 * BS, cu_seqlens=cu), ValueError,
                                    r"compress\(k, block_size=16, cu_seqlens=...\) gives for k's TK = 32 tokens, 3 "
                                    r"\(NC, axis 1\), got shape \(1, 5, 2, 8\)"),
    "k_cmp packed under jit": (lambda: jax.jit(lambda c: nsa.attention(q, k, v, k_cmp=k_cmp[:, :3], block_size=BS,
                                                                       cu_seqlens=c))(cu), ValueError,
                               r"gives for k's TK = 32 tokens, between 4 and 5 \(NC, axis 1\), got shape \(1, 3, 2, 8\)"),
    "k_cmp of a cache without kv_lens": (lambda: nsa.attention(q[:, :1], k, v, g_cmp=g[:, :1], k_cmp=k_cmp, v_cmp=k_cmp,
                                                               block_size=BS), ValueError,
                                         r"k_cmp was given with k longer than q \(TK = 32 > T = 1\), a KV cache's, "
                                         r"but kv_lens was not: pass cache=cache"),
    "k_cmp of another block (compressed_attention)": (
        lambda: nsa.compressed_attention(q, k_cmp, k_cmp, block_size=2 * BS), ValueError,
        r"k_cmp must have the rows compress\(k, block_size=16\) gives for q's T = 32 tokens, 2 \(NC, axis 1\), got "
        r"shape \(1, 4, 2, 8\)"),
    "k_cmp of another block (select_blocks)": (
        lambda: nsa.select_blocks(q, nsa.compress(k, block_size=4), block_counts=2, block_size=BS), ValueError,
        r"gives for q's T = 32 tokens, 4 \(NC, axis 1\), got shape \(1, 8, 2, 8\)"),
    # a gate of a branch that is off
    "g_swa without a window": (lambda: nsa.attention(q, k, v, g_swa=g), ValueError,
                               r"g_swa was given with window_size = 0: the sliding-window branch it weighs is off"),
    # attention's keys: arrays or a cache
    "no keys": (lambda: nsa.attention(q), TypeError, r"attention needs the keys and values: k and v, or cache="),
    "k_cmp dtype": (lambda: nsa.attention(q, k, v, k_cmp=k_cmp.astype(jnp.bfloat16)), TypeError,
                    r"k_cmp.dtype must equal q.dtype \(float32\), got bfloat16"),
    "v_cmp without k_cmp": (lambda: nsa.attention(q, k, v, v_cmp=k_cmp), ValueError,
                            r"v_cmp was given without k_cmp"),
    "k_cmp without v_cmp": (lambda: nsa.attention(q, k, v, g_cmp=g, k_cmp=k_cmp, block_size=BS), ValueError,
                            r"the compressed branch \(g_cmp given\) needs v_cmp with k_cmp"),
    "v_cmp shape": (lambda: nsa.attention(q, k, v, g_cmp=g, k_cmp=k_cmp, v_cmp=k_cmp[:, :, :1], block_size=BS),
                    ValueError,
                    r"v_cmp must have shape \[B, NC, H, Dv\] .*= \(1, 4, 2, 8\), got \(1, 4, 1, 8\)"),
    "Dk mismatch": (lambda: nsa.sliding_window_attention(q, jnp.zeros((B, T, H, D + 1)), v, window_size=4),
                    ValueError, r"k must have shape .*\(1, 32, 2, 8\), got \(1, 32, 2, 9\)"),
    "H mismatch k/v": (lambda: nsa.attention(q, k, jnp.zeros((B, T, 1, D))), ValueError,
                       r"v must have shape .*\(1, 32, 2, 8\), got \(1, 32, 1, 8\)"),
    # dtypes
    "integer q": (lambda: nsa.attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), TypeError,
                  r"q.dtype must be one of float16, bfloat16, float32, float64, got int32"),
    "k dtype differs": (lambda: nsa.attention(q, k.astype(jnp.bfloat16), v), TypeError,
                        r"k.dtype must equal q.dtype \(float32\), got bfloat16"),
    "not an array": (lambda: nsa.attention([[1.0]], k, v), TypeError, r"q must be an array, got list"),
    # gates
    "gate shape": (lambda: nsa.attention(q, k, v, g_slc=g[:, :, :2]), ValueError,
                   r"g_slc must have shape \[B, T, HQ\] = \(1, 32, 4\), got \(1, 32, 2\)"),
    "gate dtype": (lambda: nsa.attention(q, k, v, g_cmp=g.astype(jnp.int32)), TypeError,
                   r"g_cmp must have a floating dtype, got int32"),
    # block_indices and block_counts
    "block_indices float": (lambda: nsa.selected_attention(q, k, v, idx.astype(jnp.float32)), TypeError,
                            r"block_indices must have an integer dtype, got float32"),
    "block_indices shape": (lambda: nsa.selected_attention(q, k, v, idx[:, :, :1]), ValueError,
                            r"block_indices must have shape \[B, T, H, S\] with \[B, T, H\] = \(1, 32, 2\), got \(1, 32, 1, 2\)"),
    "block_indices rank": (lambda: nsa.attention(q, k, v, block_indices=idx[..., 0]), ValueError,
                           r"block_indices must have 4 dimensions, got shape \(1, 32, 2\)"),
    "block_counts shape": (lambda: nsa.selected_attention(q, k, v, idx, block_counts=jnp.ones((B, T, HQ), jnp.int32)),
                           ValueError, r"block_counts must have shape \[B, T, H\] = \(1, 32, 2\), got \(1, 32, 4\)"),
    "block_counts float": (lambda: nsa.selected_attention(q, k, v, idx, block_counts=jnp.ones((B, T, H))), TypeError,
                           r"block_counts must have an integer dtype, got float32"),
    "block_counts negative": (lambda: nsa.attention(q, k, v, block_counts=-1), ValueError,
                              r"block_counts must be >= 0, got -1"),
    "select block_counts 0": (lambda: nsa.select_blocks(q, k_cmp, block_counts=0, block_size=BS), ValueError,
                              r"block_counts must be > 0, got 0"),
    "block_counts None": (lambda: nsa.attention(q, k, v, block_counts=None), ValueError,
                          r"block_counts=None .* needs block_indices"),
    "traced block_counts": (lambda: jax.jit(lambda c: nsa.attention(q, k, v, block_counts=c))(jnp.ones((B, T, H), jnp.int32)),
                            ValueError, r"block_counts is a traced array and block_indices is None"),
    # sizes
    "block_size 0": (lambda: nsa.attention(q, k, v, block_size=0), ValueError, r"block_size must be > 0, got 0"),
    "block_size float": (lambda: nsa.compress(k, block_size=8.0), TypeError, r"block_size must be an int, got float"),
    "window_size < 0": (lambda: nsa.attention(q, k, v, window_size=-1), ValueError, r"window_size must be >= 0, got -1"),
    "sliding window_size < 0": (lambda: nsa.sliding_window_attention(q, k, v, window_size=-3), ValueError,
                                r"window_size must be >= 0, got -3"),
    "scale array": (lambda: nsa.attention(q, k, v, scale=jnp.ones(2)), TypeError,
                    r"scale must be a number, a 0-d real array or None, got an array of shape \(2,\)"),
    "scale <= 0": (lambda: nsa.attention(q, k, v, scale=0.0), ValueError, r"scale must be a finite number > 0, got 0.0"),
    "scale nan array": (lambda: nsa.sliding_window_attention(q, k, v, window_size=2, scale=jnp.float32(jnp.nan)),
                        ValueError, r"scale must be a finite number > 0, got nan"),
    "block_size traced": (lambda: jax.jit(lambda b: nsa.compress(k, block_size=b))(jnp.int32(8)), TypeError,
                          r"block_size must be a static int \(it sets array shapes\), got a traced 0-d int32 array"),
    "window_size float array": (lambda: nsa.sliding_window_attention(q, k, v, window_size=jnp.float32(3)), TypeError,
                                r"window_size must be an int, got"),
    # cu_seqlens
    "cu_seqlens with B = 2": (lambda: nsa.attention(jnp.zeros((2, T, HQ, D)), jnp.zeros((2, T, H, D)), jnp.zeros((2, T, H, D)),
                                                    cu_seqlens=cu), ValueError, r"cu_seqlens .* needs batch size B = 1, got B = 2"),
    "cu_seqlens float": (lambda: nsa.attention(q, k, v, cu_seqlens=cu.astype(jnp.float32)), TypeError,
                         r"cu_seqlens must have an integer dtype, got float32"),
    "cu_seqlens rank": (lambda: nsa.compress(k, block_size=BS, cu_seqlens=cu[None]), ValueError,
                        r"cu_seqlens must have 1 dimensions, got shape \(1, 3\)"),
    "cu_seqlens too short": (lambda: nsa.attention(q, k, v, cu_seqlens=cu[:1]), ValueError,
                             r"cu_seqlens must have shape \[N \+ 1\] with N >= 1 sequences, got \(1,\)"),
    # a concrete cu_seqlens has its values checked by every op
    "cu_seqlens decreasing": (lambda: nsa.compress(k, block_size=BS, cu_seqlens=[0, 20, 10, T]), ValueError,
                              r"cu_seqlens must not decrease, got cu_seqlens\[1\] = 20 > cu_seqlens\[2\] = 10"),
    "cu_seqlens start": (lambda: nsa.selected_attention(q, k, v, idx, cu_seqlens=jnp.array([10, 20, T])), ValueError,
                         r"cu_seqlens must start at 0, got cu_seqlens\[0\] = 10"),
    "cu_seqlens end": (lambda: nsa.sliding_window_attention(q, k, v, window_size=3, cu_seqlens=np.array([0, 30])),
                       ValueError, r"cu_seqlens must end at T = 32, got cu_seqlens\[-1\] = 30"),
    "cu_seqlens end (compressed)": (lambda: nsa.compressed_attention(q, k_cmp, k_cmp, block_size=BS, cu_seqlens=(0, 33)),
                                    ValueError, r"cu_seqlens must end at T = 32, got cu_seqlens\[-1\] = 33"),
    "cu_seqlens decreasing (select)": (lambda: nsa.select_blocks(q, k_cmp, block_counts=2, block_size=BS,
                                                                 cu_seqlens=[0, 20, 10, T]),
                                       ValueError, r"cu_seqlens must not decrease"),
    "cu_seqlens list of floats": (lambda: nsa.attention(q, k, v, cu_seqlens=[0.0, 32.0]), TypeError,
                                  r"cu_seqlens must have an integer dtype, got float64"),
    # compressed keys
    "k_cmp too short": (lambda: nsa.compressed_attention(q, k_cmp[:, :2], k_cmp[:, :2], block_size=BS), ValueError,
                        r"k_cmp must have the rows compress\(k, block_size=8\) gives for q's T = 32 tokens, 4 "
                        r"\(NC, axis 1\), got shape \(1, 2, 2, 8\)"),
    "v_cmp rows": (lambda: nsa.compressed_attention(q, k_cmp, k_cmp[:, :3], block_size=BS), ValueError,
                   r"v_cmp must have shape \[B, NC, H, Dv\].*\(1, 4, 2, 8\), got \(1, 3, 2, 8\)"),
    "k_cmp heads": (lambda: nsa.select_blocks(q, k_cmp[:, :, :1].repeat(3, 2), block_counts=2, block_size=BS), ValueError,
                    r"must be a multiple of the key/value heads H \(k.shape\[2\] = 3\)"),
    # context_axis outside jax.shard_map
    "context_axis unbound (attention)": (lambda: nsa.attention(q, k, v, context_axis="sp"), ValueError,
                                         r"context_axis = 'sp' must name a mesh axis of the jax.shard_map the op runs "
                                         r"inside.*no such axis is bound here: call the op inside jax.shard_map"),
    "context_axis unbound (window)": (lambda: nsa.sliding_window_attention(q, k, v, window_size=4, context_axis="sp"),
                                      ValueError, r"context_axis = 'sp' must name a mesh axis"),
    # a KV cache of another dtype than a floating one
    "empty_cache int dtype": (lambda: nsa.empty_cache(1, 8, H, D, block_size=BS, dtype=jnp.int32), TypeError,
                              r"dtype must be one of float16, bfloat16, float32, float64, got int32"),
    "empty_paged_cache bool dtype": (lambda: nsa.empty_paged_cache(2, 8, 1, 2, H, D, block_size=BS, dtype=bool),
                                     TypeError, r"dtype must be one of float16, bfloat16, float32, float64, got bool"),
    "empty_cache not a dtype": (lambda: nsa.empty_cache(1, 8, H, D, block_size=BS, dtype="fp8"), TypeError,
                                r"dtype must be one of float16, bfloat16, float32, float64, got 'fp8'"),
    # implementation
    "unknown implementation": (lambda: nsa.attention(q, k, v, implementation="cuda"), ValueError,
                               r"implementation must be one of \(None, 'xla', 'triton', 'pallas'\), got 'cuda'"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_arguments_raise_at_trace_time(case):
    call, error, message = case
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name", ["HQ not a multiple of H", "gate shape", "block_indices float", "window_size < 0"])
def test_errors_raise_under_jit_before_anything_runs(name):
    call, error, message = CASES[name]
    with pytest.raises(error, match=message):
        jax.jit(call).lower()


@pytest.mark.parametrize("cu_seqlens, error, message", [
    (np.array([0, 5, 3, 32]), ValueError, r"must not decrease, got cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"),
    ([0, 5, 30], ValueError, r"must end at T = 32, got cu_seqlens\[-1\] = 30"),
    ((1, 5, 32), ValueError, r"must start at 0, got cu_seqlens\[0\] = 1"),
    (np.array([0.0, 32.0]), TypeError, r"cu_seqlens must have an integer dtype, got float64"),
    (np.array([[0, 32]]), ValueError, r"cu_seqlens must have 1 dimensions, got shape \(1, 2\)"),
])
def test_check_cu_seqlens_rejects_what_the_ops_reject(cu_seqlens, error, message):
    with pytest.raises(error, match=message):
        nsa.check_cu_seqlens(cu_seqlens, T)
    with pytest.raises(error, match=message):
        nsa.sliding_window_attention(q, k, v, window_size=3, cu_seqlens=cu_seqlens)


def test_check_cu_seqlens_accepts_empty_sequences_and_needs_concrete_values():
    nsa.check_cu_seqlens(np.array([0, 5, 5, 32]), T)
    nsa.check_cu_seqlens([0, 32], T)
    nsa.check_cu_seqlens(jnp.array([0, 32]), T)
    with pytest.raises(ValueError, match=re.escape("needs a concrete cu_seqlens (call it outside jit)")):
        jax.jit(lambda c: nsa.check_cu_seqlens(c, T))(cu)


def test_explicit_pallas_on_float64_raises():
    """Pallas kernels take float32, bfloat16, float16: asking for them on float64 raises, naming the op."""
    with jax.enable_x64(True):
        x = jnp.zeros((1, 8, 2, 8), jnp.float64)
        with pytest.raises(TypeError, match=r"implementation='pallas' cannot run sliding_window_attention on "
                                            r"float64 inputs: its kernels take float32, bfloat16, float16"):
            nsa.sliding_window_attention(x, x[:, :, :1], x[:, :, :1], window_size=4, implementation="pallas")


def test_forward_mode_autodiff_raises_saying_nsa_is_reverse_mode_only():
    """jax.jvp and jax.jacfwd of an op, and jax.jvp of the selected attention of a decode step over a paged cache
    (Pallas reads the pages in a forward of its own: another custom_vjp, as a fused serving step is), raise nsa's
    TypeError, which says what works and how to get a JVP, not JAX's "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function"."""
    message = r"nsa's ops have no forward-mode derivative \(jax.jvp, jax.jacfwd, jax.hessian\).* jax.linear_transpose"
    window = lambda q: nsa.sliding_window_attention(q, k, v, window_size=4)
    with pytest.raises(TypeError, match=message):
        jax.jvp(window, (q,), (q,))
    with pytest.raises(TypeError, match=message):
        jax.jacfwd(lambda q: nsa.attention(q, k, v, block_counts=2, block_size=BS).sum())(q)
    pool, table, lens = jnp.zeros((4, 16, H, 128)), jnp.array([[1, 3]]), jnp.array([20])  # heads the kernel reads
    blocks = jnp.array([[[[1, 0]] * H]], jnp.int32)
    step = lambda q: nsa.api._paged_selected_attention(q, pool, pool, blocks, 2, lens, table, block_size=BS,
                                                       scale=1.0, implementation="pallas")
    one = jnp.ones((B, 1, HQ, 128))
    with pytest.raises(TypeError, match=message):
        jax.jvp(step, (one,), (one,))
