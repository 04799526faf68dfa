"""A KV cache for serving NSA: a dataclass of arrays with its compression as static metadata (a pytree), and
pure functions that fill it.

The cache holds, for B sequences of up to N tokens (its capacity), made with one set of blocks (static: the
cache's pytree structure, not arrays): selection blocks of l' = `block_size` tokens, compression windows of
l = `compress_block_size` tokens every d = `compress_stride` tokens (both default block_size, as nsa.attention's):

- k [B, N, H, Dk], v [B, N, H, Dv]: the keys and values, token t of sequence b at row t;
- k_cmp [B, ceil(N / d), H, Dk], v_cmp [B, ceil(N / d), H, Dv]: the compressed keys and values
  (`nsa.compress`'s window means), row i written once its window is complete (token i * d + l - 1 has arrived),
  never before, so a decode step never compresses the cache again;
- lens int32 [B]: how many tokens each sequence holds (sequences may differ: a ragged batch).

Rows past a sequence's length (and compressed rows of blocks not yet complete) hold whatever was there;
`nsa.attention` never reads them. A decode or chunked-prefill step appends the new tokens' keys and values
with `append_to_cache`, then attends with the cache, which brings its keys, compressed rows, lengths and
block size along (so none can be mismatched or forgotten):

    cache = nsa.append_to_cache(cache, k_new, v_new)        # k_new [B, TN, H, Dk]
    o = nsa.attention(q_new, cache=cache, g_cmp=..., ...)   # q_new [B, TN, HQ, Dk]

Both are pure: under `jax.jit(step, donate_argnums=...)` with the cache donated, XLA writes the new rows in
place (scatters into the donated buffers), and the step compiles once for every length, since the lengths
are data.
"""

from typing import Optional

import jax.numpy as jnp
import numpy as np

from nsa import _checks
from nsa._kvcache import KVCache, check_cache
from nsa._varlen import cdiv, concrete
from nsa.api import Array, Indices, compress

__all__ = ["KVCache", "append_to_cache", "check_cache", "empty_cache", "prefill_cache"]


def _blocks(block_size, compress_block_size, compress_stride):
    """(l', l, d) checked as nsa.attention checks them."""
    block_size = _checks.positive_int("block_size", block_size)
    return (block_size,) + _checks.compression(block_size, compress_block_size, compress_stride)


def empty_cache(batch_size: int, capacity: int, num_kv_heads: int, head_dim: int, *, block_size: int,
                compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None,
                head_dim_v: Optional[int] = None, dtype: jnp.dtype = jnp.bfloat16) -> KVCache:
    """A cache of `batch_size` empty sequences of up to `capacity` tokens (zeros, lens 0), with selection blocks
    of `block_size` tokens and compression windows of `compress_block_size` tokens every `compress_stride` (both
    default block_size)."""
    B = _checks.non_negative_int("batch_size", batch_size)
    N = _checks.non_negative_int("capacity", capacity)
    H = _checks.positive_int("num_kv_heads", num_kv_heads)
    Dk = _checks.positive_int("head_dim", head_dim)
    Dv = Dk if head_dim_v is None else _checks.positive_int("head_dim_v", head_dim_v)
    blocks = _blocks(block_size, compress_block_size, compress_stride)
    NC = cdiv(N, blocks[2])
    zeros = lambda rows, d: jnp.zeros((B, rows, H, d), dtype)
    return KVCache(zeros(N, Dk), zeros(N, Dv), zeros(NC, Dk), zeros(NC, Dv), jnp.zeros((B,), jnp.int32), *blocks)


def _new_tokens(cache, k, v):
    """Checks the new tokens k [B, TN, H, Dk], v [B, TN, H, Dv] against the cache."""
    B, N, H, Dk = cache.k.shape
    for name, x, y in (("k", k, cache.k), ("v", v, cache.v)):
        _checks.array(name, x, 4, dtypes=None)
        if x.dtype != y.dtype:
            raise TypeError(f"{name}.dtype must equal the cache's ({y.dtype.name}), got {x.dtype.name}")
        _checks.shape(name, x, (B, k.shape[1], H, y.shape[3]), f"[B, TN, H, D] (B, H, D from cache.{name})")


def _write(cache, k, v, start, lens, window, stride):
    """The cache with k, v [B, TN, ...] written at the rows start[b] + i of each sequence (rows past the
    capacity dropped), lens set to `lens` (clipped to the capacity) and the compressed row of every window (of
    `window` tokens every `stride`) that `lens` completes among those whose last token the written rows hold."""
    B, N = cache.k.shape[:2]
    TN = k.shape[1]
    NC = cache.k_cmp.shape[1]
    b = jnp.arange(B)[:, None]
    rows = start[:, None] + jnp.arange(TN)
    k_all = cache.k.at[b, rows].set(k, mode="drop")  # out-of-bounds rows (past N) are dropped
    v_all = cache.v.at[b, rows].set(v, mode="drop")
    lens = jnp.minimum(lens, N)
    # the windows whose last token (row * stride + window - 1) is one of start ... start + TN - 1: at most R
    R = cdiv(TN, stride)
    rows = -((window - 1 - start[:, None]) // stride) + jnp.arange(R)  # [B, R], the first: cdiv(start - window + 1, d)
    complete = (rows >= 0) & (rows * stride + window <= lens[:, None])
    first = jnp.maximum(rows, 0)[:, :, None] * stride
    tokens = jnp.minimum(first + jnp.arange(window), max(N - 1, 0)).reshape(B, -1)
    target = jnp.where(complete, rows, NC)  # NC: dropped

    def compressed(x_all, x_cmp):
        means = compress(x_all[b, tokens], block_size=window)  # [B, R, H, D], the window means
        return x_cmp.at[b, target].set(means, mode="drop")

    return cache.replace(k=k_all, v=v_all, k_cmp=compressed(k_all, cache.k_cmp), v_cmp=compressed(v_all, cache.v_cmp),
                         lens=lens)


def append_to_cache(cache: KVCache, k: Array, v: Array, *, block_size: Optional[int] = None,
                    compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None) -> KVCache:
    """The cache with TN new tokens appended to every sequence: k [B, TN, H, Dk], v [B, TN, H, Dv] go to the
    rows lens[b] ... lens[b] + TN - 1, lens grows by TN, and each compression window this completes gets its
    compressed row (`nsa.compress`'s mean of its tokens, bitwise). A pure function: jit it with the cache donated
    and the writes happen in place. The block arguments may be left out: the cache carries its own (given, each
    must equal the cache's).

    Appending past the capacity N raises ValueError when cache.lens is concrete; under jit (lens traced) the
    tokens that do not fit are dropped, lens stops at N, and nothing is written out of bounds.
    """
    _, window, stride = check_cache(cache, block_size, compress_block_size, compress_stride)
    _new_tokens(cache, k, v)
    N, TN = cache.k.shape[1], k.shape[1]
    lens = concrete(cache.lens)
    if lens is not None and lens.size and int(np.max(lens)) + TN > N:
        b = int(np.argmax(lens))
        raise ValueError(f"appending {TN} tokens past the cache's capacity N = {N}: cache.lens[{b}] = {lens[b]}")
    start = cache.lens.astype(jnp.int32)
    return _write(cache, k, v, start, start + TN, window, stride)


def prefill_cache(k: Array, v: Array, *, block_size: int, capacity: int, lens: Optional[Indices] = None,
                  compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None) -> KVCache:
    """A cache of capacity N = `capacity` filled from prompts k [B, TP, H, Dk], v [B, TP, H, Dv]: sequence b
    holds the first lens[b] tokens (int [B], default TP: right-padded prompts of several lengths), with the
    compressed rows of its complete windows. Blocks: as `empty_cache`'s."""
    _checks.array("k", k, 4)
    B, TP, H, Dk = k.shape
    blocks = _blocks(block_size, compress_block_size, compress_stride)
    N = _checks.non_negative_int("capacity", capacity)
    if TP > N:
        raise ValueError(f"the prompts (k.shape[1] = {TP} tokens) must fit the cache's capacity, got capacity = {N}")
    cache = empty_cache(B, N, H, Dk, block_size=blocks[0], compress_block_size=blocks[1], compress_stride=blocks[2],
                        head_dim_v=v.shape[-1], dtype=k.dtype)
    _new_tokens(cache, k, v)
    return _write(cache, k, v, jnp.zeros((B,), jnp.int32), _prompt_lens(lens, B, TP), *blocks[1:])


def _prompt_lens(lens, B, TP):
    """lens as int32 [B] (None: TP): a concrete one must lie in [0, TP], a traced one is clipped there."""
    if lens is None:
        return jnp.full((B,), TP, jnp.int32)
    return _checks.lengths("lens", lens, B, 0, TP, "[0, TP = k.shape[1]]")
