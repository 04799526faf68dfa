"""jax's own splash attention kernels (jax.experimental.pallas.ops.tpu.splash_attention) as the window and
compressed branches run them on a TPU (`window.by_splash`, `compressed.by_splash`): the layout around the kernels,
their tiles, and a backward that takes the forward's residuals instead of running the forward again.

Layout: the batch is folded into the heads, q [B, T, HQ, Dk] as [B * HQ, TP, Dk] and k, v [B, TK, H, D] as
[B * H, KP, D] (TP, KP: T and TK zero-padded to a multiple of 128); splash's MHA kernel has query head b * HQ + j
read KV head (b * HQ + j) // G = b * H + j // G, its own batch row's (nsa's grouped heads; splash's batching rule
under vmap failed at B = 2 in interpret mode). The caller's `mask` gives the [TP, KP] mask of one head: a
computable splash mask (evaluated in the kernel from the query and key indices: a [TP, KP] array in memory would
not fit at long T), the same for every head; the padded keys must be masked, the padded queries are cut (and get
a zero cotangent).

Tiles: blocks of `block(TP)` queries and `block(KP)` keys in every kernel (forward, dq, dk/dv): the largest of
512, 256, 128 that divides the padded length (512 is MaxText's default). A block of 512 takes few grid steps.

Forward: `make_splash_mha(..., save_residuals=True)`, splash's public kernel, on q pre-scaled (rounded to q's
dtype, as splash takes it): o and lse (natural log of the scaled logits, nsa's). Grid (heads, query blocks, the
key blocks the mask leaves: the grid shrunk to the most any query block sees); each step loads one block of q and
one of k and v (the next nonempty one, from the mask's block tables in SMEM).

Backward: splash's own dq and dk/dv kernels (private functions of splash_attention_kernel, `PRIVATE_FUNCTIONS`),
called here with the forward's o and lse: splash's public backward only comes with a forward run again inside
jax.vjp. With a cotangent dlse of lse (compressed attention's lse feeds block selection), d lse_t / d s_tj = p_tj
adds dlse_t to dp_tj: ds = p (dp - di + dlse), which the kernels compute as p (dp - di') with
di' = sum(o * do) - dlse. A query that sees no key (lse -inf, o 0) gets lse +inf and di' 0 in the backward:
p = exp(s - lse) is then exactly 0 in every kernel (splash's forward leaves such a row a finite mean of its block's
values, and in its backward a nonzero p). Two kernels: dq, grid (heads, query blocks, key blocks seen), each step
loading a block of q, do, lse, di' and one of k and v; dk/dv, grid (key blocks, heads, query blocks seen), each step
loading a block of k and v (held while the query blocks pass) and one of q, do, lse, di'. Not splash's fused one
(use_fused_bwd_kernel), which writes dq once per key block in q's dtype, to be summed outside the kernel. On a TPU v5e
(2026-12-06, docs/tpu.md) the whole path is within 1.12-1.13x of splash's own for the window and 1.14-1.37x for
compressed attention, forward and backward.
"""

import inspect

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel, splash_attention_mask

from nsa._plan import padded
from nsa._varlen import round_up
from nsa.pallas.tpu._common import lanes

SPLASH_BLOCKS = (512, 256, 128)  # the tiles tried, largest first: the largest that divides the padded length
SPLASH_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

# Splash's private names used here, the same in jax 0.10.2 and 0.11.2 (checked at import: `_check_private`):
# splash_attention_kernel's two backward kernels (name: the keywords passed), splash_attention_mask's base class of
# the masks computed in the kernel (compressed.py's mask), and the attributes of the SplashAttentionKernel that
# make_splash_mha returns (its backward's block tables; in `kwargs`, its tiles, mask function and masked logit).
PRIVATE_FUNCTIONS = {
    "_splash_attention_bwd_dq": ("bq", "bkv", "is_mqa", "mask_info", "mask_value", "attn_logits_soft_cap",
                                 "q_layout", "k_layout", "v_layout", "mask_function", "interpret"),
    "_splash_attention_bwd_dkv": ("bq", "bkv", "bkv_compute", "is_mqa", "mask_info", "mask_value",
                                  "attn_logits_soft_cap", "use_fused_bwd_kernel", "q_layout", "k_layout",
                                  "v_layout", "mask_function", "interpret"),
}
PRIVATE_MASK = "_ComputableMask"
PRIVATE_ATTRIBUTES = ("dq_mask_info", "dkv_mask_info", "kwargs")
PRIVATE_KWARGS = ("block_sizes", "mask_function", "mask_value")


def _check_private():
    """ImportError naming jax's version if splash lacks a name of PRIVATE_FUNCTIONS (or one of its keywords) or
    PRIVATE_MASK."""
    missing = [] if hasattr(splash_attention_mask, PRIVATE_MASK) else [f"splash_attention_mask.{PRIVATE_MASK}"]
    for name, keywords in PRIVATE_FUNCTIONS.items():
        function = getattr(splash_attention_kernel, name, None)
        parameters = () if function is None else inspect.signature(function).parameters
        missing += [f"splash_attention_kernel.{name}({k}=)" for k in keywords if k not in parameters]
    if missing:
        raise ImportError(f"nsa.pallas.tpu._splash expected splash attention's private {missing} (as in jax 0.10.2 "
                          f"and 0.11.2); jax {jax.__version__} lacks them")


_check_private()
ComputableMask = getattr(splash_attention_mask, PRIVATE_MASK)  # a mask evaluated in the kernel


def takes(q, v):
    """Whether splash takes heads q [B, T, HQ, Dk], v [B, TK, H, Dv]: bfloat16 or float32, Dk and Dv whole lanes
    (multiples of 128), a static batch (folded into the heads)."""
    return (jnp.dtype(q.dtype) in SPLASH_DTYPES and q.shape[3] % lanes() == 0 and v.shape[3] % lanes() == 0
            and isinstance(q.shape[0], int))


def block(length):
    """Splash's tile along a padded length (a multiple of 128): the largest of SPLASH_BLOCKS that divides it."""
    return max(b for b in SPLASH_BLOCKS if length % b == 0)


def kernel(mask, heads, *, residuals, interpret):
    """Splash's MHA kernel of `heads` query heads, each under the 2-D `mask` [TP, KP], tiles `block` of each.
    Built per call, never cached: the kernel holds its mask's block tables as arrays, which a cache would carry
    from one trace into the next (a leaked tracer, seen on a TPU v5e)."""
    bq, bkv = (block(n) for n in mask.shape)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                              block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, save_residuals=residuals, interpret=interpret)


def _backward_parts(run, mask):
    """The kernel `run`'s (dq MaskInfo, dk/dv MaskInfo, BlockSizes, the keywords both backward kernels share);
    ImportError naming jax's version if it lacks a PRIVATE_ATTRIBUTES or PRIVATE_KWARGS."""
    missing = [a for a in PRIVATE_ATTRIBUTES if not hasattr(run, a)]
    missing += [f"kwargs[{k!r}]" for k in PRIVATE_KWARGS if k not in getattr(run, "kwargs", {})]
    if missing:
        raise ImportError(f"nsa.pallas.tpu._splash expected make_splash_mha's kernel to hold {missing} (as in jax "
                          f"0.10.2 and 0.11.2); jax {jax.__version__} lacks them")
    if not isinstance(mask, ComputableMask):
        raise ValueError(f"splash backward: expected a mask computed in the kernel ({PRIVATE_MASK}), received "
                         f"{type(mask).__name__}")
    sizes = run.kwargs["block_sizes"]
    keywords = dict(is_mqa=False, mask_value=run.kwargs["mask_value"], attn_logits_soft_cap=None,
                    q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
                    mask_function=run.kwargs["mask_function"])
    return run.dq_mask_info, run.dkv_mask_info, sizes, keywords


def _heads(x, rows):
    """x [B, R, H, D] as splash reads it: [B * H, rows, D], rows zero-padded."""
    return jnp.transpose(padded(x, 1, rows), (0, 2, 1, 3)).reshape(-1, rows, x.shape[3])


def _unheads(x, B, T):
    """x [B * H, rows, D] from splash back to [B, T, H, D]."""
    return jnp.transpose(x.reshape(B, -1, *x.shape[1:]), (0, 2, 1, 3))[:, :T]


def _head_rows(x, rows, fill):
    """A per-query value x [B, T, HQ] as splash reads it: [B * HQ, rows], the padded queries' `fill`."""
    x = jnp.transpose(x, (0, 2, 1)).reshape(-1, x.shape[1])
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1])), constant_values=fill)


def padded_rows(n):
    """n rows (queries or keys) as splash takes them: padded to whole lanes."""
    return round_up(max(n, 1), lanes())


def _padded_shape(q, k):
    """(TP, KP): q's and k's rows padded."""
    return padded_rows(q.shape[1]), padded_rows(k.shape[1])


def forward(mask, q, k, v, segments, *, scale, interpret):
    """Splash attention of q [B, T, HQ, Dk] over k, v [B, TK, H, D] under mask((TP, KP)), a 2-D splash mask of
    the padded shape (module docstring; segments a splash.SegmentIds of the padded rows, or None):
    o [B, T, HQ, Dv] (q's dtype), lse [B, T, HQ] float32."""
    B, T, HQ, _ = q.shape
    TP, KP = _padded_shape(q, k)
    run = kernel(mask((TP, KP)), B * HQ, residuals=True, interpret=interpret)
    o, (lse,) = run(_heads((q * scale).astype(q.dtype), TP), _heads(k, KP), _heads(v, KP), segments)
    lse = jnp.transpose(lse.reshape(B, HQ, TP), (0, 2, 1))[:, :T]
    return _unheads(o, B, T), lse.astype(jnp.float32)


def backward(mask, q, k, v, segments, o, lse, do, dlse=None, *, scale, interpret):
    """Gradients (dq, dk, dv) of `forward` (its arguments, o and lse; lse -inf where a query sees no key) for the
    cotangents do [B, T, HQ, Dv] and dlse [B, T, HQ] (None: lse is not an output), without running the forward
    again (module docstring)."""
    B, T, HQ, _ = q.shape
    TP, KP = _padded_shape(q, k)
    two_d = mask((TP, KP))
    dq_info, dkv_info, sizes, keywords = _backward_parts(
        kernel(two_d, B * HQ, residuals=False, interpret=interpret), two_d)
    seen = lse > -jnp.inf  # else a query that sees no key: lse +inf, so p = exp(s - lse) = 0 in the backward
    di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    di = jnp.where(seen, di if dlse is None else di - dlse.astype(jnp.float32), 0.0)
    args = (_heads((q * scale).astype(q.dtype), TP), _heads(k, KP), _heads(v, KP), segments, None,
            _head_rows(jnp.where(seen, lse, jnp.inf), TP, jnp.inf), _heads(do.astype(q.dtype), TP),
            _head_rows(di, TP, 0.0))
    _, dk, dv = splash_attention_kernel._splash_attention_bwd_dkv(
        *args, **keywords, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv, bkv_compute=sizes.block_kv_dkv_compute,
        mask_info=dkv_info, use_fused_bwd_kernel=False, interpret=interpret)
    dq = splash_attention_kernel._splash_attention_bwd_dq(*args, **keywords, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
                                                          mask_info=dq_info, interpret=interpret)
    dq = _unheads((dq.astype(jnp.float32) * scale).astype(q.dtype), B, T)  # scaled in splash's layout: moves q.dtype
    return dq, _unheads(dk, B, k.shape[1]).astype(k.dtype), _unheads(dv, B, k.shape[1]).astype(v.dtype)
