"""Sliding-window attention on the Triton flash kernels (nsa/triton/_flash.py).

Query t, at key row r (its own token's row of k: t itself, or kv_lens[b] - T + t when the queries are the
last T tokens of longer sequences in a KV cache k, v [B, TK, H, D]), sees the key rows
[max(sequence start, r - window_size + 1), r]; signatures and residuals are those of
nsa.reference.window. `config` (a _flash.Config; None: its default) sets the kernels' tiles. A few queries at
the end of a cache (`decode.applies`; config None) run the flash-decoding forward of nsa/triton/decode.py.
"""

from nsa._varlen import window_key_range
from nsa.triton import _flash, decode


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ])."""
    if kv_lens is not None and config is None and decode.applies(q, k):
        o, lse = decode.window(q, k, v, kv_lens, window_size=window_size, scale=scale)
    else:
        lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
        o, lse = _flash.attend(q, k, v, lo, hi, scale=scale, config=config)
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
    dq, dk, dv = _flash.attend_backward(q, k, v, lo, hi, o, lse, do, scale=scale,
                                        query_span=min(int(window_size), q.shape[1]), config=config)
    return dq, dk, dv, None, None
