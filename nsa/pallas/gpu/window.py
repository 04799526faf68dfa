"""Sliding-window attention on the Mosaic GPU flash kernels (nsa/pallas/gpu/_flash.py).

The contract and the residuals are nsa.reference.window's, the decomposition ../tpu/window.py's: query t
at key row p sees the key rows [max(sequence start, p - window_size + 1), p], a key row is seen by at most W =
min(window_size, TK) queries (the span that splits the dk/dv walk), and a long KV cache is first cut to the rows
its queries' windows span (`nsa._plan.window_keys`); the backward scatters dk and dv back. `config` (a
_flash.Config; None: its default_config) goes to the kernels.
"""

import jax.numpy as jnp

from nsa._device import facts
from nsa._plan import window_keys, window_uncut
from nsa.pallas.gpu import _flash
from nsa.pallas.gpu._common import padded_dim, tokens_at_once

# the calls (B * T tokens) below which this backward outruns Triton's on the H200 (bf16, HQ = 64, H = 4, D = 128,
# window 512; benchmarks/results/ops-window-8192-65536.json, each backward as forward+backward less forward): 3.00
# against 3.23 ms at 8k, 3.67 against 5.41 at 16k, 6.72 against 9.41 at 32k, 12.88 against 12.47 at 64k
BACKWARD_TOKENS = 65536


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


def outruns_backward(residuals, do, *, window_size, scale, config=None):
    """Whether this backward outruns Triton's on `forward`'s residuals (either family's forward: both keep the
    reference's), its claim on implementation=None's choice (nsa.pallas.gpu.CLAIMS): a static True on calls of
    fewer than BACKWARD_TOKENS tokens whose tiles fit the device's shared memory; a static False on longer ones and
    on a KV cache's queries (kv_lens: not measured)."""
    del do, window_size, scale
    q, k, v, _, kv_lens = residuals[:5]
    if kv_lens is not None or tokens_at_once(q) >= BACKWARD_TOKENS:
        return False
    device = facts("cuda")
    tiles = _flash._config(config, q, k, v, device)
    dkp, dvp = padded_dim(q.shape[3], q.dtype), padded_dim(v.shape[3], v.dtype)
    return _flash.forward_shared_memory(tiles, dkp, dvp, jnp.dtype(q.dtype).itemsize) <= device.shared_memory
