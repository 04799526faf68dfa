"""Sliding-window attention on the Triton flash kernels (nsa/triton/_flash.py).

Query t sees the key rows [max(sequence start, t - window_size + 1), t]; signatures and residuals are
those of nsa.reference.window. `config` (a _flash.Config; None: its default) sets the kernels' tiles.
"""

import jax.numpy as jnp

from nsa._varlen import tokens
from nsa.triton import _flash


def _key_range(T, window_size, cu_seqlens):
    """lo, hi int32 [T]: the visible keys of query t (empty for window_size 0)."""
    tok = tokens(T, 1, cu_seqlens)
    t = jnp.arange(T, dtype=jnp.int32)
    W = min(int(window_size), T)  # window_size may be huge: keep t - W + 1 in int32
    return jnp.maximum(tok.start[0], t - W + 1), t


def forward(q, k, v, cu_seqlens, *, window_size, scale, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ])."""
    lo, hi = _key_range(q.shape[1], window_size, cu_seqlens)
    o, lse = _flash.attend(q, k, v, lo, hi, scale=scale, config=config)
    return o, (q, k, v, cu_seqlens, o, lse)


def backward(residuals, do, *, window_size, scale, config=None):
    """Gradients (dq, dk, dv, None)."""
    q, k, v, cu_seqlens, o, lse = residuals
    lo, hi = _key_range(q.shape[1], window_size, cu_seqlens)
    dq, dk, dv = _flash.attend_backward(q, k, v, lo, hi, o, lse, do, scale=scale,
                                        query_span=min(int(window_size), q.shape[1]), config=config)
    return dq, dk, dv, None
