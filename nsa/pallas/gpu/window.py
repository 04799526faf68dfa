"""Sliding-window attention on the Mosaic GPU flash kernels (nsa/pallas/gpu/_flash.py).

The contract and the residuals are nsa.reference.window's, the decomposition ../tpu/window.py's: query t
at key row p sees the key rows [max(sequence start, p - window_size + 1), p], a key row is seen by at most W =
min(window_size, TK) queries (the span that splits the dk/dv walk), and a long KV cache is first cut to the rows
its queries' windows span (`nsa._plan.window_keys`); the backward scatters dk and dv back. `config` (a
_flash.Config; None: its default_config) goes to the kernels.
"""

from nsa._plan import window_keys, window_uncut
from nsa.pallas.gpu import _flash


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    k_seen, v_seen, lo, hi, _, _ = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    o, lse = _flash.attend(q, k_seen, v_seen, lo, hi, scale=scale, config=config, name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    k_seen, v_seen, lo, hi, span, start = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    dq, dk, dv = _flash.attend_backward(q, k_seen, v_seen, lo, hi, o, lse, do, scale=scale, query_span=span,
                                        config=config, name="window")
    return (dq, *window_uncut(k, v, dk, dv, start), None, None)
