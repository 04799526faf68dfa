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


def tokens(seq_len, block_size, cu_seqlens=None):
    """The `Tokens` of a length-`seq_len` axis, packed by `cu_seqlens` [N + 1] if given."""
    t = jnp.arange(seq_len, dtype=jnp.int32)
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
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def num_compressed_blocks(seq_len, block_size, cu_seqlens=None):
    """Rows of `compress`'s output: ceil(T / block_size), or sum_i ceil(len_i / block_size) packed.

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


def check_cu_seqlens(cu_seqlens, seq_len):
    """Checks the values of a concrete `cu_seqlens` (opt-in: ops cannot check values under jit).

    Raises ValueError unless cu_seqlens starts at 0, never decreases (empty sequences are allowed)
    and ends at `seq_len`, the T of the packed q, k and v.
    """
    cu = concrete(cu_seqlens)
    if cu is None:
        raise ValueError("check_cu_seqlens needs a concrete cu_seqlens (call it outside jit)")
    if cu.ndim != 1 or cu.shape[0] < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be an integer array [N + 1], N >= 1, got {cu.dtype} {cu.shape}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    steps = np.diff(cu)
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0))
        raise ValueError(f"cu_seqlens must not decrease, got cu_seqlens[{i}] = {cu[i]} > "
                         f"cu_seqlens[{i + 1}] = {cu[i + 1]}")
    if cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens must end at T = {seq_len}, got cu_seqlens[-1] = {cu[-1]}")


def visible_compressed_rows(seq_len, block_size, cu_seqlens=None):
    """How many rows of k_cmp some query can see (every later row is padding), or None if unknown.

    A query sees only complete blocks of its own sequence: T // bs rows, or with a concrete
    cu_seqlens max_i(first row of sequence i + len_i // bs). None for a traced cu_seqlens.
    """
    if cu_seqlens is None:
        return seq_len // block_size
    cu = concrete(cu_seqlens)
    if cu is None:
        return None
    lengths = np.diff(cu.astype(np.int64))
    blocks = cdiv(lengths, block_size)
    return int(np.max(np.cumsum(blocks) - blocks + lengths // block_size))
