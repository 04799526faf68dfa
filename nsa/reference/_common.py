"""Pieces shared by the reference branches: the masked softmax, its gradient, and query chunking.

Each branch computes logits s [B, Tc, H, G, K] for a chunk of Tc queries (the G query heads of a KV
head side by side) against K candidate keys, with a boolean mask of the keys it may attend. The
forward keeps only the log-sum-exp; the backward recomputes the probabilities from it.
"""

import jax
import jax.numpy as jnp
from jax import lax

from nsa._varlen import cdiv

# Live bytes one chunk of queries may take: large enough to keep XLA busy, small enough that the
# standard shape at T = 8192 runs forward and backward in a few GB.
CHUNK_BYTES = 1 << 27


def acc_dtype(dtype):
    """The accumulation dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def group_heads(x, num_kv_heads):
    """[B, T, HQ, ...] -> [B, T, H, G, ...]: query head j belongs to KV head j // G."""
    return x.reshape(*x.shape[:2], num_kv_heads, x.shape[2] // num_kv_heads, *x.shape[3:])


def ungroup_heads(x):
    """[B, T, H, G, ...] -> [B, T, HQ, ...]."""
    return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], *x.shape[4:])


def softmax(s, mask):
    """Softmax of the logits s [..., K] over the keys where mask is True.

    Returns p [..., K] and lse [...] (natural log). A row with no visible key gets p = 0, lse = -inf.
    """
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, initial=-jnp.inf)  # initial: K may be 0 (no compressed rows at T = 0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    seen = total > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return e / jnp.where(seen, total, 1.0)[..., None], lse


def probabilities(s, mask, lse):
    """Recomputes the softmax probabilities [..., K] from the saved lse [...]."""
    seen = jnp.isfinite(lse)[..., None]
    return jnp.where(mask & seen, jnp.exp(s - jnp.where(seen, lse[..., None], 0.0)), 0.0)


def dlogits(p, dp, delta, dlse=None):
    """Gradient of the logits: p * (dp - delta + dlse), with delta = sum(o * do) per row."""
    d = dp - delta[..., None]
    if dlse is not None:
        d = d + dlse[..., None]
    return p * d


def delta(o, do):
    """The pre-pass of the backward: sum(o * do) over the value dim, [B, T, HQ]."""
    acc = acc_dtype(o.dtype)
    return jnp.sum(o.astype(acc) * do.astype(acc), axis=-1)


def chunk_size(seq_len, bytes_per_query):
    """A power-of-two number of queries per chunk that keeps a chunk under CHUNK_BYTES."""
    fit = max(1, CHUNK_BYTES // max(1, bytes_per_query))
    return min(1 << (fit.bit_length() - 1), max(seq_len, 1))


def scan_queries(body, carry, xs, *, chunk):
    """Runs `body(carry, xs_chunk) -> (carry, ys_chunk)` over consecutive chunks of queries.

    `xs` is a pytree of arrays [B or 1, T, ...]; they are zero-padded to a multiple of `chunk` (padded
    queries have do = 0, so they add nothing to any gradient). Returns the final carry and the
    outputs `ys` [B, T, ...] with the padding cut off.
    """
    seq_len = jax.tree_util.tree_leaves(xs)[0].shape[1]
    num = cdiv(seq_len, chunk)

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, num * chunk - seq_len)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(x.shape[0], num, chunk, *x.shape[2:]), 0, 1)

    def merge(y):
        y = jnp.swapaxes(y, 0, 1)
        return y.reshape(y.shape[0], num * chunk, *y.shape[3:])[:, :seq_len]

    carry, ys = lax.scan(body, carry, jax.tree_util.tree_map(split, xs))
    return carry, jax.tree_util.tree_map(merge, ys)


def gather_tokens(x, idx):
    """x [B, T, H, D] gathered at per-head token indices idx [B, Tc, H, K] -> [B, Tc, H, K, D]."""
    b = jnp.arange(x.shape[0])[:, None, None, None]
    h = jnp.arange(x.shape[2])[None, None, :, None]
    return x[b, idx, h]


def scatter_add_tokens(acc, idx, updates):
    """The transpose of `gather_tokens`: adds updates [B, Tc, H, K, D] into acc [B, T, H, D]."""
    b = jnp.arange(acc.shape[0])[:, None, None, None]
    h = jnp.arange(acc.shape[2])[None, None, :, None]
    return acc.at[b, idx, h].add(updates)
