"""Token positions for batched and packed (cu_seqlens) sequences.

Every op is written once, for the packed case: each token knows its in-sequence position, the global
index of its sequence's first token, and the global row of its sequence's compressed block 0. Without
cu_seqlens each batch row is one sequence starting at 0.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Tokens(NamedTuple):
    """Per-token layout, each field int32 [1, T] (broadcasts over the batch)."""

    pos: jax.Array  # in-sequence position t
    start: jax.Array  # global index of the sequence's first token
    cmp_start: jax.Array  # global row of the sequence's compressed block 0 in k_cmp / v_cmp


def cdiv(a, b):
    return -(-a // b)


def tokens(seq_len, block_size, cu_seqlens=None, kv_lens=None):
    """The `Tokens` of a length-`seq_len` axis of queries.

    - packed by `cu_seqlens` [N + 1]: each field [1, T], positions restart at each sequence start;
    - at the end of longer sequences, `kv_lens` int [B] (a KV cache: the queries are the last T tokens of
      sequence b's kv_lens[b]): each field [B, T], query i at position kv_lens[b] - T + i, start and
      cmp_start 0 (keys and compressed rows are indexed by position);
    - else: each field [1, T], query i at position i.
    """
    t = jnp.arange(seq_len, dtype=jnp.int32)
    if kv_lens is not None:
        pos = kv_lens.astype(jnp.int32)[:, None] - seq_len + t[None]
        zero = jnp.zeros_like(pos)
        return Tokens(pos, zero, zero)
    if cu_seqlens is None:
        zero = jnp.zeros_like(t)
        return Tokens(t[None], zero[None], zero[None])
    cu = cu_seqlens.astype(jnp.int32)
    num_seqs = cu.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, num_seqs - 1)
    blocks = cdiv(cu[1:] - cu[:-1], block_size)
    first_block = jnp.cumsum(blocks) - blocks
    start = cu[seq]
    return Tokens((t - start)[None], start[None], first_block[seq][None])


def concrete(x):
    """`x` as a NumPy array if its value is known at trace time, else None."""
    if isinstance(x, jax.core.Tracer):  # a traced value (never convertible; asking builds an error message, which
        return None                     # jax 0.10.2 can crash on when the trace mixes IO effects)
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def num_compressed_blocks(seq_len, block_size, cu_seqlens=None):
    """Rows of `compress`'s output: ceil(T / block_size), or sum_i ceil(len_i / block_size) packed. With
    overlapping windows (`compress(..., stride=d)`) the rows are counted by the stride: pass block_size=d.

    A traced `cu_seqlens` has no known lengths: then the static upper bound over all packings of
    T tokens into N sequences, min(T, (T + N * (block_size - 1)) // block_size); the rows past the
    real blocks are zero and never read.
    """
    if cu_seqlens is None:
        return cdiv(seq_len, block_size)
    cu = concrete(cu_seqlens)
    if cu is not None:
        return int(np.sum(cdiv(np.diff(cu.astype(np.int64)), block_size)))
    num_seqs = cu_seqlens.shape[0] - 1
    return min(seq_len, (seq_len + num_seqs * (block_size - 1)) // block_size)


def _per_query(x, kv_lens):
    """A per-query range end as the kernels take it: [T] shared by the batch, or [B, T] with kv_lens."""
    return x if kv_lens is not None else x[0]


def window_key_range(seq_len, window_size, cu_seqlens=None, kv_lens=None):
    """lo, hi int32 [T] ([B, T] with kv_lens): query t of a sliding window sees the key rows [lo, hi] =
    [max(sequence start, p - window_size + 1), p] of its sequence, p its global key row (start + position);
    empty for window_size 0. Both non-decreasing in t."""
    tok = tokens(seq_len, 1, cu_seqlens, kv_lens)
    row = tok.start + tok.pos
    W = min(int(window_size), 1 << 30)  # window_size may be huge: keep row - W + 1 in int32
    return _per_query(jnp.maximum(tok.start, row - W + 1), kv_lens), _per_query(row, kv_lens)


def complete_rows(pos, block_size, stride=None):
    """How many compressed rows of its sequence the query at in-sequence position `pos` sees: rows i whose window
    [i * stride, i * stride + block_size) lies wholly in its past (i * stride + block_size <= pos + 1); stride
    None is block_size (blocks that do not overlap: (pos + 1) // block_size)."""
    if stride is None or stride == block_size:
        return (pos + 1) // block_size
    return jnp.maximum(pos + 1 - block_size + stride, 0) // stride


def compressed_key_range(seq_len, num_rows, block_size, cu_seqlens=None, kv_lens=None, stride=None):
    """lo, hi int32 [T] ([B, T] with kv_lens): query t sees the rows [lo, hi] of k_cmp [B, num_rows, ...],
    those of its sequence's complete windows of block_size tokens every `stride` (None: block_size;
    `complete_rows`), empty before its first one; none past row num_rows - 1, which under jit a cu_seqlens may
    ask for; both non-decreasing in t."""
    tok = tokens(seq_len, block_size if stride is None else stride, cu_seqlens, kv_lens)
    lo = tok.cmp_start
    hi = jnp.minimum(lo + complete_rows(tok.pos, block_size, stride) - 1, num_rows - 1)
    return _per_query(lo, kv_lens), _per_query(hi, kv_lens)


def query_ranges(lo, hi, num_keys):
    """first, last int32 [NK] ([B, NK] for lo, hi [B, T]): the queries that see key row r are
    [first[r], last[r]] (empty if first > last).

    Valid because lo and hi are non-decreasing in t: {t: lo[t] <= r} is a prefix of the queries and
    {t: hi[t] >= r} a suffix.
    """
    if lo.ndim == 2:
        return jax.vmap(query_ranges, in_axes=(0, 0, None))(lo, hi, num_keys)
    r = jnp.arange(num_keys, dtype=jnp.int32)
    first = jnp.searchsorted(hi, r, side="left").astype(jnp.int32)
    last = (jnp.searchsorted(lo, r, side="right") - 1).astype(jnp.int32)
    return first, last


def made_valid(cu_seqlens, seq_len):
    """A traced cu_seqlens made valid, as the ops use it (they cannot raise on a value under jit): each
    entry clipped to [0, seq_len] after a running maximum (an entry below the one before it ends an empty
    sequence there), then the first set to 0 and the last to seq_len (tokens before the first entry join
    the first sequence, tokens after the last one the last sequence). A valid cu_seqlens is unchanged."""
    cu = jnp.clip(jax.lax.cummax(cu_seqlens.astype(jnp.int32)), 0, seq_len)
    return cu.at[0].set(0).at[-1].set(seq_len)


def round_up(a, b):
    """a rounded up to a multiple of b."""
    return cdiv(a, b) * b
