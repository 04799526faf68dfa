"""Sliding-window attention on the Triton flash kernels (nsa/triton/_flash.py).

Query t sees the key rows [max(sequence start, t - window_size + 1), t]; signatures and residuals are
those of nsa.reference.window. `config` (a _flash.Config; None: its default) sets the kernels' tiles.
"""

from nsa._varlen import window_key_range
from nsa.triton import _flash


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ])."""
    if kv_lens is not None:  # TEMPORARY (issue 10): being added to the kernels
        raise NotImplementedError("kv_lens is not supported by this kernel yet")
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens)
    o, lse = _flash.attend(q, k, v, lo, hi, scale=scale, config=config)
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, config=None):
    """Gradients (dq, dk, dv, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens)
    dq, dk, dv = _flash.attend_backward(q, k, v, lo, hi, o, lse, do, scale=scale,
                                        query_span=min(int(window_size), q.shape[1]), config=config)
    return dq, dk, dv, None, None
