"""Sliding-window attention on the Pallas TPU flash kernels (nsa/pallas/_flash.py).

Query t, at key row p (t itself, or kv_lens[b] - T + t at the end of a KV cache's sequence b), sees the key
rows [max(sequence start, p - window_size + 1), p]; signatures and residuals are those of
nsa.reference.window. A tile of BQ queries sees at most BQ + W - 1 key rows (W = min(window_size, TK), TK =
k's rows) and a key row is seen by at most W queries: the spans that size the kernels' grids. `interpret`
(False: Mosaic, or a pltpu.InterpretParams) and `config` (a _flash.Config; None: its default) go to the
kernels.
"""

from nsa._varlen import window_key_range
from nsa.pallas import _flash


def _spans(TK, window_size, config):
    """(key_span, query_span) of the kernels over TK key rows."""
    W = max(1, min(int(window_size), TK))
    return (config or _flash.Config()).block_q + W - 1, W


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, interpret=False, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
    key_span, _ = _spans(k.shape[1], window_size, config)
    o, lse = _flash.attend(q, k, v, lo, hi, scale=scale, key_span=key_span, interpret=interpret, config=config,
                           name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, interpret=False, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
    key_span, query_span = _spans(k.shape[1], window_size, config)
    dq, dk, dv = _flash.attend_backward(q, k, v, lo, hi, o, lse, do, scale=scale, key_span=key_span,
                                        query_span=query_span, interpret=interpret, config=config, name="window")
    return dq, dk, dv, None, None
