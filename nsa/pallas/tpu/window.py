"""Sliding-window attention on the Pallas TPU flash kernels (nsa/pallas/tpu/_flash.py).

Query t, at key row p (t itself, or kv_lens[b] - T + t at the end of a KV cache's sequence b), sees the key
rows [max(sequence start, p - window_size + 1), p]; signatures and residuals are those of
nsa.reference.window. A query sees at most W key rows (W = min(window_size, TK), TK = k's rows) and a key row
is seen by at most W queries: the spans that size the kernels' grids. With a KV cache longer than the
L = T + W - 1 rows the T queries' windows span (a decode step, a short chunk), k and v are first cut to those
rows of each batch row (`nsa._plan.window_keys`: the kernels never see, and XLA never copies or relays out, the
rest of the cache); the backward scatters dk and dv back. `interpret` (False: Mosaic, or a
pltpu.InterpretParams) and `config` (a _flash.Config; None: its default_config) go to the kernels.
"""

from nsa._plan import window_keys, window_uncut
from nsa.pallas.tpu import _flash


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, interpret=False, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    k_seen, v_seen, lo, hi, span, _ = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    o, lse = _flash.attend(q, k_seen, v_seen, lo, hi, scale=scale, key_span=span, interpret=interpret,
                           config=config, name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, interpret=False, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    k_seen, v_seen, lo, hi, span, start = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    dq, dk, dv = _flash.attend_backward(q, k_seen, v_seen, lo, hi, o, lse, do, scale=scale, key_span=span,
                                        query_span=span, interpret=interpret, config=config, name="window")
    return (dq, *window_uncut(k, v, dk, dv, start), None, None)
