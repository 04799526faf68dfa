"""Sliding-window attention on the Pallas TPU flash kernels (nsa/pallas/_flash.py).

Query t, at key row p (t itself, or kv_lens[b] - T + t at the end of a KV cache's sequence b), sees the key
rows [max(sequence start, p - window_size + 1), p]; signatures and residuals are those of
nsa.reference.window. A tile of BQ queries sees at most BQ + W - 1 key rows (W = min(window_size, TK), TK =
k's rows) and a key row is seen by at most W queries: the spans that size the kernels' grids. With a KV cache
longer than the L = T + W - 1 rows the T queries' windows span (a decode step, a short chunk), k and v are
first cut to those rows of each batch row (a gather of L rows per KV head: the kernels never see, and XLA
never copies or relays out, the rest of the cache); the backward scatters dk and dv back. `interpret`
(False: Mosaic, or a pltpu.InterpretParams) and `config` (a _flash.Config; None: its default) go to the
kernels; `gpu=True` runs the Mosaic GPU flash kernels instead (nsa/pallas/gpu/_flash.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nsa._varlen import window_key_range
from nsa.pallas import _flash


def _spans(TK, window_size, config):
    """(key_span, query_span) of the kernels over TK key rows."""
    W = max(1, min(int(window_size), TK))
    return (config or _flash.Config()).block_q + W - 1, W


def _span_start(T, TK, window_size, kv_lens):
    """With a KV cache longer than the L = T + W - 1 key rows its T queries' windows span (a decode step):
    int32 [B], the first of them in each batch row (kv_lens[b] - L, or 0 for a shorter sequence); else None."""
    if kv_lens is None or window_size < 1 or T + window_size - 1 >= TK:
        return None
    return jnp.maximum(kv_lens.astype(jnp.int32) - (T + int(window_size) - 1), 0)


def _cut(x, start, rows):
    """x [B, TK, H, D] -> [B, rows, H, D]: the rows from start[b] on of each batch row (a gather)."""
    return jax.vmap(lambda x, s: lax.dynamic_slice_in_dim(x, s, rows, axis=0))(x, start)


def _attended(q, k, v, cu_seqlens, kv_lens, window_size, config):
    """What the kernels take: k, v (cut to the window's span with a long cache: a decode step copies L rows
    per KV head, never the cache), lo, hi, and the spans; plus the cut's start (None when uncut)."""
    start = _span_start(q.shape[1], k.shape[1], window_size, kv_lens)
    if start is not None:
        rows = q.shape[1] + int(window_size) - 1
        k, v, kv_lens = _cut(k, start, rows), _cut(v, start, rows), kv_lens - start
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
    return k, v, lo, hi, _spans(k.shape[1], window_size, config), start


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, interpret=False, config=None, gpu=False):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    k_seen, v_seen, lo, hi, (key_span, _), _ = _attended(q, k, v, cu_seqlens, kv_lens, window_size, config)
    attend, _ = _flash.kernels(interpret, config, gpu)
    o, lse = attend(q, k_seen, v_seen, lo, hi, scale=scale, key_span=key_span, name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, interpret=False, config=None, gpu=False):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    k_seen, v_seen, lo, hi, (key_span, query_span), start = _attended(q, k, v, cu_seqlens, kv_lens, window_size,
                                                                      config)
    _, attend_backward = _flash.kernels(interpret, config, gpu)
    dq, dk, dv = attend_backward(q, k_seen, v_seen, lo, hi, o, lse, do, scale=scale, key_span=key_span,
                                 query_span=query_span, name="window")
    if start is not None:  # the cut's transpose: dk, dv scattered back to the cache's rows
        uncut = lambda x, dx: jax.vjp(functools.partial(_cut, start=start, rows=dx.shape[1]), x)[1](dx)[0]
        dk, dv = uncut(k, dk), uncut(v, dv)
    return dq, dk, dv, None, None
