"""Sliding-window attention on TPUs: jax's own splash attention kernels where they apply (`by_splash`), else the
Pallas TPU flash kernels of nsa/pallas/tpu/_flash.py.

Query t, at key row p (t itself, or kv_lens[b] - T + t at the end of a KV cache's sequence b), sees the key
rows [max(sequence start, p - window_size + 1), p]; signatures and residuals are those of
nsa.reference.window. `interpret` (False: Mosaic, or a pltpu.InterpretParams) and `config` (a _flash.Config;
None: its default_config, or splash where it applies) go to the kernels.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention): without a KV cache the window is a local mask
of the [T, T] logits (key j seen by query t iff t - window_size < j <= t), packed sequences are its segment ids
(one per sequence of cu_seqlens: no key crosses a boundary), and grouped heads its MHA kernel with H KV heads
(query head j on KV head j // G, as nsa's contract), the batch folded into the heads. On a TPU v5e it ran 4.2x
faster than the flash kernels here, forward and backward (2026-12-06, 8k tokens, HQ = 64, H = 4, D = 128, bf16,
window 512: 3.9 / 12.2 ms against 17.1 / 50.8; benchmarks/results/tpu-train/): its blocks of 512 queries and keys
take few grid steps. `by_splash` takes it for bfloat16 and float32 heads of whole lanes (Dk, Dv multiples of 128),
window_size >= 1, a static batch (folded into the heads), no KV cache and no Config (a Config sets the flash
kernels' tiles). The forward runs splash with save_residuals (its lse, natural log of the scaled logits: the
reference's), the backward splash's own gradient of a forward it runs again (public API only: splash keeps its
backward's residuals to itself), q pre-scaled in both (rounded to q's dtype, as splash takes it). T is padded to a
multiple of 128 (the padded keys come after every real query, the padded queries are cut and get a zero cotangent).

The flash kernels take the rest (KV caches, float16, other heads, explicit tiles). A query sees at most W key
rows (W = min(window_size, TK), TK = k's rows) and a key row is seen by at most W queries: the spans that size
their grids. With a KV cache longer than the L = T + W - 1 rows the T queries' windows span (a decode step, a
short chunk), k and v are first cut to those rows of each batch row (`nsa._plan.window_keys`: the kernels never
see, and XLA never copies or relays out, the rest of the cache); the backward scatters dk and dv back.
"""

import functools

import jax
import jax.numpy as jnp

from nsa._plan import padded, window_keys, window_uncut
from nsa._varlen import round_up
from nsa.pallas.tpu import _flash
from nsa.pallas.tpu._common import lanes

SPLASH_BLOCK = 512  # splash's tiles (queries and keys, every kernel), capped at the padded T; MaxText's default
SPLASH_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def by_splash(q, v, kv_lens, window_size, config):
    """Whether the window of q [B, T, HQ, Dk] over v [B, TK, H, Dv] runs splash attention (module docstring)."""
    return (config is None and kv_lens is None and int(window_size) >= 1 and jnp.dtype(q.dtype) in SPLASH_DTYPES
            and q.shape[3] % lanes() == 0 and v.shape[3] % lanes() == 0 and isinstance(q.shape[0], int))


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, interpret=False, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    if by_splash(q, v, kv_lens, window_size, config):
        o, lse = _splash(q, k, v, cu_seqlens, window_size=window_size, scale=scale, interpret=interpret,
                         residuals=True)
        return o, (q, k, v, cu_seqlens, kv_lens, o, lse)
    k_seen, v_seen, lo, hi, span, _ = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    o, lse = _flash.attend(q, k_seen, v_seen, lo, hi, scale=scale, key_span=span, interpret=interpret,
                           config=config, name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, interpret=False, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    if by_splash(q, v, kv_lens, window_size, config):
        run = functools.partial(_splash, cu_seqlens=cu_seqlens, window_size=window_size, scale=scale,
                                interpret=interpret, residuals=False)
        dq, dk, dv = jax.vjp(run, q, k, v)[1](do.astype(q.dtype))
        return dq, dk, dv, None, None
    k_seen, v_seen, lo, hi, span, start = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    dq, dk, dv = _flash.attend_backward(q, k_seen, v_seen, lo, hi, o, lse, do, scale=scale, key_span=span,
                                        query_span=span, interpret=interpret, config=config, name="window")
    return (dq, *window_uncut(k, v, dk, dv, start), None, None)


def _splash_kernel(T, heads, window_size, residuals, interpret):
    """Splash's MHA kernel of `heads` query heads over [T, T] logits under the local mask of window_size (T a
    multiple of 128). Built per call, never cached: the kernel holds its mask's block tables as arrays, which a
    cache would carry from one trace into the next (a leaked tracer, seen on a TPU v5e)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = max(b for b in (SPLASH_BLOCK, 256, 128) if T % b == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    local = splash.LocalMask((T, T), (int(window_size) - 1, 0), 0)
    return splash.make_splash_mha(splash.MultiHeadMask([local] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, save_residuals=residuals, interpret=interpret)


def _splash(q, k, v, cu_seqlens, *, window_size, scale, interpret, residuals):
    """Splash attention's window of q [B, T, HQ, Dk] over k, v [B, T, H, D]: o [B, T, HQ, Dv] (q's dtype), and
    with `residuals` lse [B, T, HQ] float32. Packed sequences (cu_seqlens int [N + 1], B = 1) as segment ids."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, HQ, _ = q.shape
    tp = round_up(max(T, 1), lanes())
    # the batch folded into the heads, [B * heads, tp, D]: query head b * HQ + j reads KV head (b * HQ + j) // G =
    # b * H + j // G, its own batch row's (splash's batching rule under vmap failed at B = 2 in interpret mode)
    heads = lambda x: jnp.transpose(padded(x, 1, tp), (0, 2, 1, 3)).reshape(-1, tp, x.shape[3])
    kernel = _splash_kernel(tp, B * HQ, int(window_size), residuals, interpret)
    segments = None
    if cu_seqlens is not None:  # token t's sequence; the padded tokens one after the last
        ids = jnp.searchsorted(cu_seqlens.astype(jnp.int32), jnp.arange(tp, dtype=jnp.int32), side="right") - 1
        ids = jnp.where(jnp.arange(tp) < T, ids, cu_seqlens.shape[0]).astype(jnp.int32)
        segments = splash.SegmentIds(q=ids, kv=ids)
    out = kernel(heads((q * scale).astype(q.dtype)), heads(k), heads(v), segments)
    o, lse = out if residuals else (out, None)
    o = jnp.transpose(o.reshape(B, HQ, tp, o.shape[2]), (0, 2, 1, 3))[:, :T]
    if not residuals:
        return o
    return o, jnp.transpose(lse[0].reshape(B, HQ, tp), (0, 2, 1))[:, :T].astype(jnp.float32)
