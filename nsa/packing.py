"""From the layouts batches arrive in to cu_seqlens, and back.

Every op takes packed sequences: B = 1 and `cu_seqlens` int [N + 1], sequence i the tokens
cu_seqlens[i] ... cu_seqlens[i + 1] - 1 of the packed axis. Batches arrive in two other layouts:

- padded, with a padding mask [B, T] (True or nonzero: a token; a tokenizer's attention_mask): `pack` moves
  the tokens of every row to the front of one packed axis of B * T tokens, row after row, and the padding
  after them; `cu_seqlens_from_mask` gives its cu_seqlens, int32 [B + 2]: the B rows' sequences, then one
  sequence of all the padding (so no row ever sees it); `unpack` brings an op's packed output back to
  [B, T, ...], zeros at the padding;
- packed, with segment ids [T] (a sequence is a run of equal ids): `cu_seqlens_from_segment_ids`, and back
  with `segment_ids_from_cu_seqlens`.

All are jittable (a padding mask and segment ids may be traced; under jit the number of segments must be
given) and differentiable where they move floats (pack and unpack are gathers).

    mask = tokens != PAD                                        # [B, T]
    cu = nsa.cu_seqlens_from_mask(mask)
    o = nsa.attention(nsa.pack(q, mask), nsa.pack(k, mask), nsa.pack(v, mask), cu_seqlens=cu, ...)
    o = nsa.unpack(o, mask)                                     # [B, T, HQ, Dv]
"""

from typing import Optional

import jax.numpy as jnp
import numpy as np

from nsa import _checks
from nsa._varlen import concrete
from nsa.api import Array, Indices


def _mask(mask):
    """A padding mask (bool or integer [B, T]) as bool."""
    if not _checks.is_array(mask):
        mask = np.asarray(mask)
    if mask.dtype != jnp.bool_ and not jnp.issubdtype(mask.dtype, jnp.integer):
        raise TypeError(f"mask must have a bool or integer dtype (nonzero: a token), got {mask.dtype.name}")
    if mask.ndim != 2:
        raise ValueError(f"mask must have 2 dimensions ([B, T]), got shape {tuple(mask.shape)}")
    return jnp.asarray(mask).astype(bool)


def _tokens_first(mask):
    """For the packed axis of B * T slots: the padded index b * T + t of the token in each slot, with every row's
    tokens first (row after row, each in order) and the padding after them."""
    B, T = mask.shape
    index = jnp.arange(B * T, dtype=jnp.int32)
    return jnp.argsort(jnp.where(mask.reshape(-1), index, B * T + index), stable=True).astype(jnp.int32)


def cu_seqlens_from_mask(mask: Indices) -> Array:
    """The cu_seqlens of `pack(x, mask)`: int32 [B + 2], sequence b (< B) row b's tokens, sequence B the padding of
    every row (B * T - the tokens; empty without padding).

    mask: bool or integer [B, T], True (nonzero) for a token. A row's tokens need not be contiguous: they are
    packed in order, and a row of no token is an empty sequence.
    """
    mask = _mask(mask)
    B, T = mask.shape
    lens = jnp.sum(mask, axis=1, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens, dtype=jnp.int32), jnp.full(1, B * T, jnp.int32)])


def _tokens_array(name, x, mask, expected):
    """Checks that x is an array whose first two dims are expected[1] (described as expected[0])."""
    if not _checks.is_array(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if tuple(x.shape[:2]) != expected[1] or x.ndim < 2:
        raise ValueError(f"{name} must have shape {expected[0]} = {expected[1]} + (...), got {tuple(x.shape)}")


def pack(x: Array, mask: Indices) -> Array:
    """x [B, T, ...] (padded, mask bool [B, T]) -> [1, B * T, ...]: every row's tokens in order, row after row, then
    zeros for the padding; the layout `cu_seqlens_from_mask(mask)` describes."""
    mask = _mask(mask)
    B, T = mask.shape
    _tokens_array("x", x, mask, ("[B, T, ...] (B, T from mask)", (B, T)))
    flat = x.reshape((B * T,) + x.shape[2:])
    source = _tokens_first(mask)
    is_token = jnp.arange(B * T) < jnp.sum(mask)
    packed = jnp.where(is_token.reshape((-1,) + (1,) * (x.ndim - 2)), flat[source], jnp.zeros((), x.dtype))
    return packed[None]


def unpack(x: Array, mask: Indices) -> Array:
    """The inverse of `pack`: x [1, B * T, ...] (an op's output on packed inputs) -> [B, T, ...] under the padding
    mask bool [B, T], zeros at the padding."""
    mask = _mask(mask)
    B, T = mask.shape
    _tokens_array("x", x, mask, ("[1, B * T, ...] (B, T from mask)", (1, B * T)))
    slot = jnp.zeros(B * T, jnp.int32).at[_tokens_first(mask)].set(jnp.arange(B * T, dtype=jnp.int32))
    out = x[0][slot].reshape((B, T) + x.shape[2:])
    return jnp.where(mask.reshape((B, T) + (1,) * (x.ndim - 2)), out, jnp.zeros((), x.dtype))


def cu_seqlens_from_segment_ids(segment_ids: Indices, *, num_segments: Optional[int] = None) -> Array:
    """cu_seqlens int32 [N + 1] of packed sequences given by segment_ids, int [T] or [1, T]: a sequence is a run of
    equal ids (ids need not be sorted or distinct across runs; a padding id is a sequence of its own).

    N is the number of runs when segment_ids is concrete; under jit (traced ids) `num_segments` must give it, and
    then the cu_seqlens has num_segments + 1 entries: fewer runs leave empty sequences at the end, and runs
    past the num_segments-th join the last sequence (a concrete segment_ids with more runs than num_segments raises).
    """
    if not _checks.is_array(segment_ids):
        segment_ids = np.asarray(segment_ids)
    ids = segment_ids[0] if segment_ids.ndim == 2 and segment_ids.shape[0] == 1 else segment_ids
    _checks.integer_array("segment_ids", ids, 1)
    T = ids.shape[0]
    known = concrete(ids)
    runs = None if known is None else int(T > 0) + int(np.sum(known[1:] != known[:-1]))
    if num_segments is None:
        if runs is None:
            raise ValueError("segment_ids is traced: pass num_segments (a static int, the number of sequences)")
        num_segments = runs
    num_segments = _checks.positive_int("num_segments", num_segments)
    if runs is not None and runs > num_segments:
        raise ValueError(f"segment_ids holds {runs} sequences (runs of equal ids), more than num_segments = {num_segments}")
    ids = jnp.asarray(ids)
    starts = jnp.nonzero(ids[1:] != ids[:-1], size=num_segments - 1, fill_value=T - 1)[0] + 1
    return jnp.concatenate([jnp.zeros(1, jnp.int32), starts.astype(jnp.int32), jnp.full(1, T, jnp.int32)])


def segment_ids_from_cu_seqlens(cu_seqlens: Indices, seq_len: int) -> Array:
    """int32 [T] (T = seq_len): the index i of each token's sequence, cu_seqlens[i] <= t < cu_seqlens[i + 1] (an
    empty sequence has no token). cu_seqlens is checked (or, traced, made valid) as the ops do."""
    T = _checks.non_negative_int("seq_len", seq_len)
    cu = _checks.cu_seqlens(cu_seqlens, 1, T)
    if cu is None:
        raise ValueError("cu_seqlens must be an int array [N + 1], got None")
    cu = jnp.asarray(cu, jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    return (jnp.searchsorted(cu, t, side="right") - 1).astype(jnp.int32)
