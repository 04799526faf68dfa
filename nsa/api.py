"""The public ops: argument checks, then one custom_vjp op each (nsa._dispatch).

Shapes: q [B, T, HQ, Dk], k [B, TK, H, Dk], v [B, TK, H, Dv], gates [B, T, HQ], outputs [B, T, HQ, Dv];
G = HQ / H query heads share each KV head (query head j uses KV head j // G). With cu_seqlens [N + 1]
(B = 1) the N sequences are packed along T and nothing crosses a sequence boundary. With TK > T (a KV
cache) the queries are the last T tokens of each sequence: query i of sequence b sits at position
kv_lens[b] - T + i (kv_lens int [B], each sequence's length in the padded cache, default TK).
"""

import functools
from collections.abc import Sequence
from typing import Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from nsa import _checks, _dispatch, context
from nsa._config import Step, as_sequences
from nsa._kvcache import (Cache, PagedKVCache, check_cache, gathered, paged_selected, paged_window,
                          readable_lens)
from nsa._plan import num_candidates
from nsa._varlen import cdiv, concrete, num_compressed_blocks
from nsa.reference.compress import row_tokens

# What the public ops take: arrays as jax.Array (or anything jnp.asarray takes); index arguments (cu_seqlens
# [N + 1], kv_lens [B], block_counts [B, T, H]) as an array, a list or a tuple; `implementation` one of these
# names or None (nsa.implementations() tells what None runs).
Array = jax.Array
Indices = Union[jax.typing.ArrayLike, Sequence[int]]
Implementation = Optional[Literal["xla", "triton", "pallas"]]


def _statics(**kwargs):
    return tuple(sorted(kwargs.items()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gated_sum(gates, outputs, dtype):
    """sum over the branches b of g_b * o_b (a None gate: o_b alone), gates [B, T, HQ], outputs [B, T, HQ, Dv],
    computed in float32 (or wider) and returned in `dtype`. Its backward (`_gated_sum_bwd`) keeps each o_b in its own
    dtype (its branch's vjp keeps it anyway), not a float32 copy of every branch's output (6 of the 12.4 GiB that
    nsa.attention's backward held at the standard shape and 64k tokens under autodiff)."""
    acc = jnp.promote_types(dtype, jnp.float32)
    return sum(o.astype(acc) if g is None else g[..., None].astype(acc) * o.astype(acc)
               for g, o in zip(gates, outputs)).astype(dtype)


def _gated_sum_fwd(gates, outputs, dtype):
    return _gated_sum(gates, outputs, dtype), (gates, outputs)


def _gated_sum_bwd(dtype, residuals, do):
    """do_b = g_b * do in o_b's dtype, from do in `dtype`: the rounding of the exact product that autodiff's float32
    product then conversion gives (a product of two bfloat16 values is exact in float32), with no float32 copy of do
    for XLA to keep; dg_b = sum over Dv of do * o_b in float32."""
    gates, outputs = residuals
    acc = jnp.promote_types(dtype, jnp.float32)
    d_outputs = tuple(do.astype(o.dtype) if g is None else (g[..., None] * do).astype(o.dtype)
                      for g, o in zip(gates, outputs))
    d_gates = tuple(None if g is None else jnp.sum(do.astype(acc) * o.astype(acc), axis=-1).astype(g.dtype)
                    for g, o in zip(gates, outputs))
    return d_gates, d_outputs


_gated_sum.defvjp(_gated_sum_fwd, _gated_sum_bwd)


def _paged_selected_attention(q, k, v, block_indices, block_counts, kv_lens, page_table, *, block_size, scale,
                              implementation):
    """Selected attention of a decode step (T = 1) over a paged cache's pools k, v [P, S, H, D]: by a kernel that
    reads the blocks through the page table itself where the family that runs the op has one (the Mosaic TPU
    kernel's copies from the pages), else the blocks gathered through the table in XLA (`paged_selected`), then the
    op; the gradient always through the latter (nsa._dispatch.paged_selected)."""
    def gathered_blocks(q, k, v, block_indices, block_counts, kv_lens, page_table):
        *blocks, lens = paged_selected(page_table, k, v, block_indices, kv_lens, block_size)
        return selected_attention(q, *blocks, block_counts=block_counts, block_size=block_size, scale=scale,
                                  kv_lens=lens, implementation=implementation)

    arrays = (q, k, v, block_indices, jnp.asarray(block_counts, jnp.int32), kv_lens, page_table)
    return _dispatch.paged_selected(implementation, _statics(block_size=block_size, scale=scale), gathered_blocks,
                                    arrays)


def _scaled(q, scale):
    """(q, scale) as the ops run them: `scale` checked (`_checks.scale`, None gives Dk ** -0.5). A traced
    scale (a learned temperature) is folded into q, q * scale rounded to q's dtype, and the op runs with
    scale 1: the kernels keep a static scale, and the gradient of scale flows through the product."""
    scale = _checks.scale(scale, q.shape[-1])
    if isinstance(scale, float):
        return q, scale
    acc = jnp.promote_types(q.dtype, jnp.float32)
    return (q.astype(acc) * scale.astype(acc)).astype(q.dtype), 1.0


def _no_queries(x):
    """Whether x [B, T, ...] holds no token (B = 0 or T = 0): the op then returns empty outputs (and
    zero gradients) without running any implementation."""
    return x.shape[0] * x.shape[1] == 0


def check_cu_seqlens(cu_seqlens: Indices, seq_len: int) -> None:
    """Checks a concrete `cu_seqlens` (an int array [N + 1], a list or a tuple) as every op does.

    Every op checks a concrete cu_seqlens itself; this is the check alone, outside any op. Raises
    TypeError for a non-integer dtype, ValueError unless cu_seqlens starts at 0, never decreases (empty
    sequences are allowed) and ends at `seq_len`, the T of the packed q, k and v, and ValueError for a
    traced cu_seqlens (whose values are unknown: the ops make it valid, see `nsa._varlen.made_valid`).
    """
    if isinstance(cu_seqlens, (list, tuple)):
        cu_seqlens = np.asarray(cu_seqlens)
    if _checks.is_array(cu_seqlens) and concrete(cu_seqlens) is None:
        raise ValueError("check_cu_seqlens needs a concrete cu_seqlens (call it outside jit)")
    _checks.cu_seqlens(cu_seqlens, 1, seq_len)


def _key_lens(kv_lens, q, k, cu_seqlens, name="kv_lens"):
    """kv_lens (called `name` in errors) checked against q [B, T, ...] and k [B, TK, ...] (`_checks.kv_lens`);
    None with TK > T means every sequence fills the cache (kv_lens = TK)."""
    B, T, TK = q.shape[0], q.shape[1], k.shape[1]
    if kv_lens is None and TK > T:
        kv_lens = np.full((B,), TK, np.int32)
    return _checks.kv_lens(kv_lens, B, T, TK, cu_seqlens, name=name)


def _compressed_kv(q, k_cmp, v_cmp, block_size, stride, cu_seqlens, kv_lens=None):
    """Checks k_cmp [B, NC, H, Dk] and v_cmp [B, NC, H, Dv] against q: without kv_lens, k_cmp holds the rows
    compress(block_size, stride) gives for q's T tokens (the queries are the whole sequences); with kv_lens
    (`_checks.kv_lens`), it covers them (kv_lens <= NC * stride); returns kv_lens."""
    _checks.array("k_cmp", k_cmp, 4, like=q)
    B, T, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    _checks.shape("k_cmp", k_cmp, (B, NC, H, Dk), "[B, NC, H, Dk] (B, Dk from q)")
    _checks.group(HQ, H)
    if v_cmp is not None:
        _checks.array("v_cmp", v_cmp, 4, like=q)
        _checks.shape("v_cmp", v_cmp, (B, NC, H, v_cmp.shape[3]), "[B, NC, H, Dv] (B from q, NC, H from k_cmp)")
    if kv_lens is not None:
        names = "block_size" if stride == block_size else "stride"
        return _checks.kv_lens(kv_lens, B, T, NC * stride, cu_seqlens, bound=f"NC * {names}, the tokens k_cmp covers")
    _compressed_rows(k_cmp, T, "q's T", block_size, stride, cu_seqlens)
    return None


def _compressed_rows(k_cmp, TK, tokens, block_size, stride, cu_seqlens):
    """Checks that k_cmp [B, NC, ...] has the rows `compress(k, block_size=block_size, stride=stride,
    cu_seqlens=cu_seqlens)` gives for TK tokens (named `tokens`): ceil(TK / stride), or the packing's; for a traced
    cu_seqlens between ceil(TK / stride) and its static bound. So compressed keys of another stride raise."""
    NC, rows = k_cmp.shape[1], num_compressed_blocks(TK, stride, cu_seqlens)
    fewest = rows if cu_seqlens is None or concrete(cu_seqlens) is not None else -(-TK // stride)
    if not fewest <= NC <= rows:
        strided = "" if stride == block_size else f", stride={stride}"
        made = f"compress(k, block_size={block_size}{strided}{', cu_seqlens=...' if cu_seqlens is not None else ''})"
        expected = f"{rows}" if fewest == rows else f"between {fewest} and {rows}"
        raise ValueError(f"k_cmp must have the rows {made} gives for {tokens} = {TK} tokens, {expected} (NC, axis 1), "
                         f"got shape {tuple(k_cmp.shape)}: compressed keys made with another block_size or stride?")


def compress(x: Array, *, block_size: int, stride: Optional[int] = None,
             cu_seqlens: Optional[Indices] = None) -> Array:
    """Means of windows of l = `block_size` tokens every d = `stride` tokens (default l: blocks that do not
    overlap): x [B, T, H, D] -> [B, ceil(T / d), H, D].

    Row i of a sequence is the mean of its tokens [i * d, min(i * d + l, len)): the last rows are averaged over
    their true length. d must divide l (the paper's NSA: l = 32, d = 16). With cu_seqlens the rows restart at
    each sequence and are packed into [1, sum_i ceil(len_i / d), H, D]; for a traced cu_seqlens (lengths
    unknown at trace time) the rows are padded with zeros to a static bound. `compression_windows` gives each
    row's tokens, for a learned compression.
    """
    _checks.array("x", x, 4)
    block_size = _checks.positive_int("block_size", block_size)
    stride = _checks.stride(stride, block_size)
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
    num_blocks = num_compressed_blocks(x.shape[1], stride, cu_seqlens)
    if _no_queries(x):
        return jnp.zeros((x.shape[0], num_blocks) + x.shape[2:], x.dtype)
    static = _statics(block_size=block_size, stride=stride, num_blocks=num_blocks)
    return _dispatch.apply("compress", None, static, (x, cu_seqlens))


def compression_windows(x: Array, *, block_size: int, stride: Optional[int] = None,
                        cu_seqlens: Optional[Indices] = None) -> tuple[Array, Array]:
    """The tokens of each compressed row, for a learned compression phi (the paper's Eq. 7): windows of
    l = `block_size` tokens every d = `stride` tokens (default l), laid out as `compress` lays out its rows.

    x [B, T, H, D] -> (windows [B, NC, l, H, D] in x's dtype, mask bool [B, NC, l]): row i of a sequence holds its
    tokens i * d ... i * d + l - 1, those past the sequence's end zeroed and False in the mask (NC = ceil(T / d),
    or with cu_seqlens the packed rows of every sequence, as `compress`). `compress` is the masked mean over
    axis 2. Apply phi to each window, e.g. k_cmp = phi(windows) [B, NC, H, Dk], and pass k_cmp and v_cmp to
    `attention` with the same compress_block_size and compress_stride; gradients flow through the windows to x.
    """
    _checks.array("x", x, 4)
    block_size = _checks.positive_int("block_size", block_size)
    stride = _checks.stride(stride, block_size)
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
    rows = num_compressed_blocks(x.shape[1], stride, cu_seqlens)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    index, used, _ = row_tokens(x.shape[1], cu, block_size, stride, rows)
    windows = jnp.where(used[None, :, :, None, None], x[:, index], 0).astype(x.dtype)
    return windows, jnp.broadcast_to(used, (x.shape[0],) + used.shape)


def compressed_attention(q: Array, k_cmp: Array, v_cmp: Array, *, block_size: int, stride: Optional[int] = None,
                         scale: Optional[float] = None, cu_seqlens: Optional[Indices] = None,
                         kv_lens: Optional[Indices] = None, context_axis: Optional[str] = None,
                         context_layout: context.Layout = "contiguous",
                         implementation: Implementation = None) -> tuple[Array, Array]:
    """Attention of each query to the compressed rows whose windows lie wholly in its past.

    k_cmp [B, NC, H, Dk] and v_cmp [B, NC, H, Dv] are laid out as `compress(..., block_size=l, stride=d)`
    returns them (stride default: block_size): the query at in-sequence position t sees row i iff
    i * d + l <= t + 1 (with d = l: block c iff (c + 1) * l - 1 <= t). The queries are the whole sequences
    (position t = query index), or with kv_lens int [B] the last T tokens of sequences of kv_lens[b] tokens,
    which k_cmp must cover (kv_lens <= NC * d).

    Returns:
      o [B, T, HQ, Dv] in q's dtype and lse [B, T, HQ] float32 (natural log); a query that sees no
      block gets o = 0 and lse = -inf. Gradients flow through both.

    context_axis, context_layout: q's and k_cmp's, v_cmp's rows (a device's) of one sequence split over a mesh axis,
    as `attention`'s.
    """
    _checks.array("q", q, 4)
    block_size = _checks.positive_int("block_size", block_size)
    stride = _checks.stride(stride, block_size)
    if context_axis is not None:
        _context_refuses(kv_lens=kv_lens)
        call = functools.partial(compressed_attention, block_size=block_size, stride=stride, scale=scale,
                                 implementation=implementation)
        keys = dict(k_cmp=(k_cmp, stride), v_cmp=(v_cmp, stride))
        return _in_context(context_axis, context_layout, q, keys, {}, call, implementation, cu_seqlens=cu_seqlens)
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    kv_lens = _compressed_kv(q, k_cmp, v_cmp, block_size, stride, cu_seqlens, kv_lens)
    q, scale = _scaled(q, scale)
    impl = _checks.implementation(implementation)
    if _no_queries(q):
        return (jnp.zeros(q.shape[:3] + v_cmp.shape[3:], q.dtype),
                jnp.zeros(q.shape[:3], jnp.promote_types(q.dtype, jnp.float32)))
    static = _statics(block_size=block_size, stride=stride, scale=scale)
    return _dispatch.apply("compressed", impl, static, (q, k_cmp, v_cmp, cu_seqlens, kv_lens))


def select_blocks(q: Array, k_cmp: Array, *, block_counts: int, block_size: int,
                  compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None,
                  scale: Optional[float] = None, cu_seqlens: Optional[Indices] = None,
                  kv_lens: Optional[Indices] = None, context_axis: Optional[str] = None,
                  context_layout: context.Layout = "contiguous", implementation: Implementation = None) -> Array:
    """The `block_counts` selection blocks of l' = `block_size` tokens each KV head attends, from the compressed
    attention scores.

    k_cmp was made with windows of l = compress_block_size tokens (default block_size) every d = compress_stride
    tokens (default gcd(l, l'), the largest stride that divides both, as it must: windows that do not overlap
    wherever l divides l'). Per query head, p(i) is the softmax of the scaled q . k_cmp over the
    visible compressed rows (as `compressed_attention`'s); selection block j scores the paper's Eq. 9,
    sum over m < l' / d and n < l / d of p((l' / d) * j + m - n) (p = 0 for rows the query does not see and for
    negative indices: each row counts by its overlap with the block, in strides); with l = d = l' that is p(j).
    A block's score is the mean over the G query heads of its group. Blocks 0, t // l' - 1 and t // l' (where
    >= 0) are always selected, ranked t // l' first, then t // l' - 1, then 0; blocks after t // l' never. The
    highest scores fill the rest; ties go to the lower block id. Positions: as `compressed_attention`'s (kv_lens
    int [B] places the queries at the end of sequences of kv_lens[b] tokens, which k_cmp must cover).

    Returns:
      int32 [B, T, H, S] in-sequence block ids, -1 in unused slots, S = min(block_counts, the blocks of the
      longest sequence: ceil(T / l'), or with kv_lens ceil(NC * d / l')), so a larger count selects every block at
      no more cost. The order inside a row is the rank order. No gradient flows through the selection.
      context_axis, context_layout: as `compressed_attention`'s.
    """
    _checks.array("q", q, 4)
    block_size = _checks.positive_int("block_size", block_size)
    block_counts = _checks.positive_int("block_counts", block_counts)
    compression = _checks.compression(block_size, compress_block_size, compress_stride)
    if context_axis is not None:
        _context_refuses(kv_lens=kv_lens)
        call = functools.partial(select_blocks, block_counts=block_counts, block_size=block_size,
                                 compress_block_size=compress_block_size, compress_stride=compress_stride, scale=scale,
                                 implementation=implementation)
        return _in_context(context_axis, context_layout, q, dict(k_cmp=(k_cmp, compression[1])), {}, call,
                           implementation, cu_seqlens=cu_seqlens)
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    kv_lens = _compressed_kv(q, k_cmp, None, *compression, cu_seqlens, kv_lens)
    block_counts = min(block_counts, num_candidates(q.shape[1], k_cmp.shape[1], block_size, kv_lens, compression[1]))
    q, scale = _scaled(q, scale)
    return _select(q, k_cmp, None, block_counts, block_size, compression, scale, cu_seqlens, kv_lens, implementation)


def _select(q, k_cmp, lse, block_counts, block_size, compression, scale, cu_seqlens, kv_lens, implementation):
    """select_blocks after its checks (compression (l, d) checked, scale None or a float); lse [B, T, HQ] is
    compressed attention's, when known (or None)."""
    impl = _checks.implementation(implementation)
    if _no_queries(q):
        return jnp.zeros(q.shape[:2] + (k_cmp.shape[2], block_counts), jnp.int32)
    static = _statics(block_counts=block_counts, block_size=block_size, compress_block_size=compression[0],
                      compress_stride=compression[1], scale=_checks.scale(scale, q.shape[-1]))
    arrays = tuple(None if x is None else jax.lax.stop_gradient(x) for x in (q, k_cmp, lse)) + (cu_seqlens, kv_lens)
    return _dispatch.run("select", impl, static, arrays)


def selected_attention(q: Array, k: Array, v: Array, block_indices: Array, *,
                       block_counts: Union[int, Indices, None] = None, block_size: int = 64,
                       scale: Optional[float] = None, cu_seqlens: Optional[Indices] = None,
                       kv_lens: Optional[Indices] = None, context_axis: Optional[str] = None,
                       context_layout: context.Layout = "contiguous", implementation: Implementation = None) -> Array:
    """Attention of each query to the raw tokens of its KV head's selected blocks.

    Query t of KV head h attends to the tokens at positions <= t of the blocks listed in
    block_indices[b, t, h, :count] (int [B, T, H, S], in-sequence block ids), count = block_counts:
    None (all S slots), an int, or an int array [B, T, H]. Entries < 0 or > t // block_size are
    ignored and never read; a block listed twice is attended twice; a query that sees nothing gets 0.
    k, v [B, TK, H, D] with TK > T hold longer sequences (a KV cache) whose last T tokens the queries are:
    sequence b has kv_lens[b] tokens (int [B], default TK) and its keys past them are never read.

    Returns o [B, T, HQ, Dv] in q's dtype; gradients for q, k and v. context_axis, context_layout: q's, k's, v's,
    block_indices' (and an array block_counts') rows of one sequence split over a mesh axis, as `attention`'s.
    """
    if context_axis is not None:
        _context_refuses(kv_lens=kv_lens)
        per_query = _checks.is_array(block_counts)  # then sharded like q, else the same for every query
        call = functools.partial(selected_attention, block_size=block_size, scale=scale, implementation=implementation,
                                 **({} if per_query else dict(block_counts=block_counts)))
        local = dict(block_indices=block_indices, **(dict(block_counts=block_counts) if per_query else {}))
        return _in_context(context_axis, context_layout, q, dict(k=(k, 1), v=(v, 1)), local, call, implementation,
                           cu_seqlens=cu_seqlens)
    B, T, HQ, H = _checks.qkv(q, k, v)
    _checks.block_indices(block_indices, B, T, H)
    block_size = _checks.positive_int("block_size", block_size)
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, B, T)
    kv_lens = _key_lens(kv_lens, q, k, cu_seqlens)
    if block_counts is None:
        block_counts = block_indices.shape[-1]
    block_counts = _checks.block_counts(block_counts, B, T, H, block_indices.shape[-1])
    counts = jnp.broadcast_to(jnp.asarray(block_counts, jnp.int32), (B, T, H))
    q, scale = _scaled(q, scale)
    impl = _checks.implementation(implementation)
    if _no_queries(q):
        return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    static = _statics(block_size=block_size, scale=scale)
    return _dispatch.apply("selected", impl, static, (q, k, v, block_indices, counts, cu_seqlens, kv_lens))


def sliding_window_attention(q: Array, k: Array, v: Array, *, window_size: int, scale: Optional[float] = None,
                             cu_seqlens: Optional[Indices] = None, kv_lens: Optional[Indices] = None,
                             context_axis: Optional[str] = None, context_layout: context.Layout = "contiguous",
                             implementation: Implementation = None) -> Array:
    """Attention of query t to the keys j of its sequence with t - window_size < j <= t.

    k, v [B, TK, H, D] with TK > T: as `selected_attention` (kv_lens, keys past them never read).
    Returns o [B, T, HQ, Dv] in q's dtype (0 where window_size = 0); gradients for q, k and v. context_axis,
    context_layout: q's, k's and v's rows of one sequence split over a mesh axis, as `attention`'s.
    """
    if context_axis is not None:
        _context_refuses(kv_lens=kv_lens)
        call = functools.partial(sliding_window_attention, window_size=window_size, scale=scale,
                                 implementation=implementation)
        return _in_context(context_axis, context_layout, q, dict(k=(k, 1), v=(v, 1)), {}, call, implementation,
                           cu_seqlens=cu_seqlens)
    B, T, HQ, H = _checks.qkv(q, k, v)
    window_size = _checks.non_negative_int("window_size", window_size)
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, B, T)
    kv_lens = _key_lens(kv_lens, q, k, cu_seqlens)
    q, scale = _scaled(q, scale)
    impl = _checks.implementation(implementation)
    if _no_queries(q):
        return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    static = _statics(window_size=window_size, scale=scale)
    return _dispatch.apply("window", impl, static, (q, k, v, cu_seqlens, kv_lens))


def _slots(block_counts):
    """The static number of slots S to select when block_indices is None (block_counts as
    `_checks.block_counts` returns it)."""
    if isinstance(block_counts, int):
        return max(1, block_counts)  # 0 selects one slot that selected_attention then leaves unused
    counts = concrete(block_counts)
    if counts is None:
        raise ValueError("block_counts is a traced array and block_indices is None: the number of "
                         "blocks to select must be static; pass an int block_counts or block_indices")
    return max(1, int(counts.max(initial=0)))


def _given_compressed(k_cmp, v_cmp, q, k, v, compression, cu_seqlens, kv_lens, needs_values):
    """Checks a precomputed k_cmp [B, NC, H, Dk] / v_cmp [B, NC, H, Dv] (a KV cache's, or a user's) against k and v
    [B, TK, ...]: its rows are those compress(k) with compression (l, d) gives (`_compressed_rows`); k longer than
    q (a cache's) needs kv_lens; v_cmp is needed with k_cmp when the compressed branch is on, and never without
    k_cmp."""
    if k_cmp is None:
        if v_cmp is not None:
            raise ValueError("v_cmp was given without k_cmp; pass both (or neither: attention compresses k and v)")
        return
    B, TK, H, Dk = k.shape
    _checks.array("k_cmp", k_cmp, 4, like=q)
    _checks.shape("k_cmp", k_cmp, (B, k_cmp.shape[1], H, Dk), "[B, NC, H, Dk] (B, H, Dk from k)")
    _compressed_rows(k_cmp, TK, "k's TK", *compression, cu_seqlens)
    if TK > q.shape[1] and kv_lens is None:
        raise ValueError(f"k_cmp was given with k longer than q (TK = {TK} > T = {q.shape[1]}), a KV cache's, but "
                         f"kv_lens was not: pass cache=cache (which brings its lengths), or kv_lens=cache.lens (each "
                         f"sequence's length; [TK] * B if every one fills the cache)")
    if v_cmp is None:
        if needs_values:
            raise ValueError("the compressed branch (g_cmp given) needs v_cmp with k_cmp; got k_cmp only")
        return
    _checks.array("v_cmp", v_cmp, 4, like=q)
    _checks.shape("v_cmp", v_cmp, k_cmp.shape[:3] + v.shape[3:], "[B, NC, H, Dv] (B, NC, H from k_cmp, Dv from v)")


def _from_cache(cache, blocks, given):
    """(k, v, k_cmp, v_cmp, kv_lens, page_table, (block_size, compress_block_size, compress_stride)) of `cache` (an
    nsa.KVCache or nsa.PagedKVCache, checked; a paged cache's pools of pages and its page table, else page_table
    None), for attention(q, cache=cache): `blocks` are the call's (block_size, compress_block_size,
    compress_stride), each None or the cache's own; `given` maps the names of the other arguments to what the call
    passed, which must be None."""
    blocks = check_cache(cache, *blocks)
    passed = [name for name, x in given.items() if x is not None]
    if passed:
        learned = [name for name in passed if name in ("k_cmp", "v_cmp")]
        hint = (" (a learned compression's rows go into the cache: `append_to_cache(..., phi=...)` and "
                "`prefill_cache(..., phi=...)` write phi's row of each window they complete)" if learned else "")
        raise ValueError(f"cache= brings the keys, values, compressed rows and lengths of the cache: pass "
                         f"{' and '.join(passed)} or cache, not both{hint}")
    if not isinstance(cache, PagedKVCache):
        return cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.lens, None, blocks
    lens = cache.lens  # concrete ones that reach a page-table entry outside the pool raised (check_cache)
    if concrete(lens) is None or concrete(cache.page_table) is None:  # under jit: no read goes through one
        lens = readable_lens(cache)
    return cache.k, cache.v, cache.k_cmp, cache.v_cmp, lens, cache.page_table, blocks


def _ragged(q, k, v, k_cmp, v_cmp, per_query, q_lens, kv_lens, compression):
    """A ragged step (attention(q_lens=...)) as the ops take it: sequence b's queries are the first q_lens[b] rows
    of q [B, T, ...], its last q_lens[b] of kv_lens[b] tokens. The ops place query i at position kv_lens[b] - T + i
    (the last T tokens), so each row of q and of the per-query arrays `per_query` ({name: [B, T, ...] or None})
    rolls forward by shift[b] = min(T, kv_lens[b]) - q_lens[b], and the ops run with kv_lens max(kv_lens[b], T):
    the valid rows then sit at positions kv_lens[b] - q_lens[b] + j, the padding before them at earlier tokens of
    the sequence (or, where kv_lens[b] < T, after them, past its end). The padding's q and gates are zeroed, so no
    gradient reaches them; with T > 1 the keys and compressed rows past each sequence are zeroed too, so that the
    padding past a short sequence's end reads no NaN (an O(TK) select: until the kernels take q_lens themselves).
    Returns (q, k, v, k_cmp, v_cmp, per_query, the ops' kv_lens, unroll: the ops' o -> o [B, T, ...], its padding
    0)."""
    B, T = q.shape[:2]
    valid = jnp.arange(T) < q_lens[:, None]  # [B, T]
    shift = jnp.minimum(T, kv_lens) - q_lens
    b = jnp.arange(B)[:, None]

    def roll(x, by):
        return None if x is None else x[b, (jnp.arange(T) - by[:, None]) % T]

    def padding_zeroed(x):
        return None if x is None else jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0).astype(x.dtype)

    def in_sequences(x, row_ends):  # x [B, R, ...] with its rows past each sequence (row_ends > kv_lens) zeroed
        keep = row_ends[None, :, None, None] <= kv_lens[:, None, None, None]
        return None if x is None else jnp.where(keep, x, 0).astype(x.dtype)

    if T > 1:
        tokens = jnp.arange(k.shape[1]) + 1
        k, v = in_sequences(k, tokens), in_sequences(v, tokens)
        if k_cmp is not None:
            windows = jnp.arange(k_cmp.shape[1]) * compression[1] + compression[0]
            k_cmp, v_cmp = in_sequences(k_cmp, windows), in_sequences(v_cmp, windows)
    per_query = {name: roll(padding_zeroed(x) if name.startswith("g_") else x, shift) for name, x in per_query.items()}
    return (roll(padding_zeroed(q), shift), k, v, k_cmp, v_cmp, per_query, jnp.maximum(kv_lens, T),
            lambda o: padding_zeroed(roll(o, -shift)))


def _in_context(axis, layout, q, keys, local, call, implementation, prepare=None, cu_seqlens=None):
    """The local rows of an op over one sequence split over mesh axis `axis` in `layout` (`nsa.context`). q
    [B, T, ...] and `local` (a dict of arrays sharded like q: gates, block_indices, per-query counts; None where not
    given) are the device's rows. `keys`: {name: (array or None, stride)}: k and v (stride 1) or compressed rows
    (stride d: [B, T / d, ...], each local chunk's, so its tokens must be a multiple of d), gathered over the axis
    in sequence order, then finished once by `prepare(gathered dict) -> dict` where given. Each local chunk of
    queries runs call(q_chunk, **keys, kv_lens=its end, **local_chunk), as the last queries of a sequence that ends
    where the chunk ends (packed, cu_seqlens over the whole sequence: `_packed_chunk`); the outputs (arrays, or
    tuples of them) are concatenated along T. Under jax.checkpoint, which keeps only these inputs: the backward
    gathers k and v again."""
    P = context.num_devices(axis)
    B, T = q.shape[:2]
    context.check_local(T, P, layout)
    chunks = context.local_chunks(T, P, jax.lax.axis_index(axis), layout)
    if cu_seqlens is not None:
        cu_seqlens = _context_packing(cu_seqlens, B, P * T, keys)
    for name, (x, stride) in keys.items():
        if x is not None and (chunks[0][1] % stride or x.shape[:2] != (B, T // stride)):
            rows = f"T / {stride}" if stride > 1 else "T"
            chunk = f" (the compressed rows of local chunks of {chunks[0][1]} tokens, a multiple of {stride})"
            raise ValueError(f"with context_axis, {name} must be sharded like q: [B, {rows}, ...] = "
                             f"[{B}, {T / stride:g}, ...]{chunk if stride > 1 else ''}, got {name}.shape = "
                             f"{tuple(x.shape)}")

    def run(q, keys, local, cu):
        whole = {name: context.gathered(x, axis, layout) for name, x in keys.items()}
        whole = prepare(whole) if prepare is not None else whole
        outs = []
        for first, rows, end in chunks:
            cut = lambda x: None if x is None else jax.lax.slice_in_dim(x, first, first + rows, axis=1)
            chunk = {name: cut(x) for name, x in local.items()}
            if cu is None:
                outs.append(call(cut(q), **whole, kv_lens=jnp.full((B,), end, jnp.int32), **chunk))
            else:
                outs.append(_packed_chunk(call, cut(q), whole, chunk, cu, rows, end))
        return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=1), *outs)

    arrays = (q, {name: x for name, (x, _) in keys.items()}, local, cu_seqlens)
    if P == 1 or (implementation == "pallas" and jax.default_backend() == "cpu"):
        # P = 1: the gathered keys are the local ones, residuals anyway (no recompute: the plain ops' cost). Pallas's
        # TPU interpret mode (nsa.pallas) runs its kernels as host callbacks, effects jax.checkpoint cannot partially
        # evaluate: there (a CPU, where memory is no concern) the gathered k and v stay residuals
        return run(*arrays)
    return jax.checkpoint(run)(*arrays)


def _compressed_locally(x, axis, layout, l, d):
    """compress(x_whole, block_size=l, stride=d)'s rows of each local chunk of x [B, T, H, D] (the device's rows
    over mesh axis `axis` in `layout`), [B, T / d, H, D] in the local chunks' order: what `_in_context` gathers as
    a given k_cmp. Each chunk's windows reach l - d tokens into the next chunk in sequence order (another
    device's): the first l - d rows of every chunk are all-gathered (tiny) for that. So the compressed rows (and
    the compressed branch and the selection on them) need nothing of the full k and v gather, which can overlap
    them. The last chunk's windows past the sequence's end take zeros for the missing tokens: no query sees those
    rows (row j is seen from position j * d + l - 1), so they change no output and no gradient. None where the
    chunks do not allow it (a chunk not a multiple of d, or shorter than l - d tokens; P = 1): then the compressed
    rows are made from the gathered keys."""
    P, (B, T) = context.num_devices(axis), x.shape[:2]
    chunks = context.local_chunks(T, P, jax.lax.axis_index(axis), layout)
    rows, halo = chunks[0][1], l - d
    if P == 1 or rows % d or halo > rows:
        return None
    if halo:  # the first `halo` rows of every chunk of the sequence, in sequence order, then zeros past the last
        heads = context.gathered(jnp.concatenate([x[:, first:first + halo] for first, _, _ in chunks], axis=1), axis,
                                 layout)
        heads = jnp.pad(heads, [(0, 0), (0, halo)] + [(0, 0)] * (x.ndim - 2))
    parts = []
    for first, _, end in chunks:
        part = x[:, first:first + rows]
        if halo:  # chunk end // rows is the next one in sequence order
            part = jnp.concatenate([part, jax.lax.dynamic_slice_in_dim(heads, end // rows * halo, halo, axis=1)], 1)
        parts.append(compress(part, block_size=l, stride=d)[:, :rows // d])
    return jnp.concatenate(parts, axis=1)


def _context_packing(cu_seqlens, B, tokens, keys):
    """cu_seqlens [N + 1] with context_axis: the packing of the whole sequence of `tokens` = P * T tokens (the same
    on every device), checked as the ops check it; ValueError where compressed rows are among `keys` (packed, a
    sequence's rows are not laid out like its tokens)."""
    given = [name for name, (x, stride) in keys.items() if x is not None and stride > 1]
    if given:
        raise ValueError(f"with context_axis and cu_seqlens, {' and '.join(given)} cannot be given: packed, each "
                         f"sequence's compressed rows are not split over the devices as its tokens are (`attention` "
                         f"given k and v alone makes them from the gathered keys)")
    values = concrete(np.asarray(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else cu_seqlens)
    if values is not None and values.ndim == 1 and values.size and values[-1] != tokens:
        raise ValueError(f"with context_axis, cu_seqlens packs the whole sequence of P * T = {tokens} tokens (T: the "
                         f"local rows) and must end there, got cu_seqlens[-1] = {values[-1]}")
    return _checks.cu_seqlens(cu_seqlens, B, tokens)


def _packed_chunk(call, q, whole, local, cu, rows, end):
    """The output of one local chunk of packed sequences: its `rows` queries are the global tokens [s, end),
    s = end - rows, of the whole sequence's keys `whole` packed by cu (B = 1). Two calls of the op, no new kernel:
    the tokens of the sequence holding token s (which may start on an earlier device, at a) run as the last queries
    of that sequence, over the keys rolled to start at a (kv_lens = end - a); the tokens of the sequences starting
    inside the chunk run packed over the chunk's own keys. Each row takes the call that placed it right."""
    s, N = end - rows, cu.shape[0] - 1
    cu = cu.astype(jnp.int32)
    first = jnp.clip(jnp.searchsorted(cu, s, side="right") - 1, 0, N - 1)  # the sequence holding token s
    start, stop = cu[first], cu[first + 1]
    rolled = {name: None if x is None else jnp.roll(x, -start, axis=1) for name, x in whole.items()}
    straddling = call(q, **rolled, kv_lens=jnp.reshape(end - start, (1,)), **local)
    own = {name: None if x is None else jax.lax.dynamic_slice_in_dim(x, s, rows, axis=1) for name, x in whole.items()}
    inside = call(q, **own, cu_seqlens=jnp.clip(cu - s, 0, rows), **local)
    takes_first = s + jnp.arange(rows) < stop  # [rows]: the row is a token of the sequence holding token s

    def pick(a, b):
        return jnp.where(takes_first.reshape((1, rows) + (1,) * (a.ndim - 2)), a, b)

    return jax.tree_util.tree_map(pick, straddling, inside)


def _attention_blocks(block_size, compress_block_size, compress_stride):
    """(l', (l, d)): attention's selection block (block_size, default 64) and compression (`_checks.compression`)."""
    block_size_default = block_size is None
    block_size = _checks.positive_int("block_size", 64 if block_size_default else block_size)
    return block_size, _checks.compression(block_size, compress_block_size, compress_stride, block_size_default)


def _context_refuses(**given):
    """ValueError if any of `given` (the arguments context_axis cannot take yet) is not None."""
    passed = [name for name, x in given.items() if x is not None]
    if passed:
        raise ValueError(f"context_axis (one sequence split over a mesh axis) cannot be given with "
                         f"{' or '.join(passed)} (not supported yet)")


def attention(q: Array, k: Optional[Array] = None, v: Optional[Array] = None, *, g_cmp: Optional[Array] = None,
              g_slc: Optional[Array] = None, g_swa: Optional[Array] = None, block_indices: Optional[Array] = None,
              block_counts: Union[int, Indices] = 16, block_size: Optional[int] = None,
              compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None, window_size: int = 0,
              scale: Optional[float] = None, cu_seqlens: Optional[Indices] = None, kv_lens: Optional[Indices] = None,
              k_cmp: Optional[Array] = None, v_cmp: Optional[Array] = None, cache: Optional[Cache] = None,
              q_lens: Optional[Indices] = None, context_axis: Optional[str] = None,
              context_layout: context.Layout = "contiguous", implementation: Implementation = None) -> Array:
    """Native Sparse Attention: o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa.

    - compressed branch (o_cmp, `compressed_attention` on `compress(k)`, `compress(v)`): on iff g_cmp
      is given;
    - selected branch (o_slc, `selected_attention`): always on; with block_indices=None the blocks come
      from `select_blocks` on the compressed keys (whether or not g_cmp is given);
    - sliding-window branch (o_swa, `sliding_window_attention`): on iff window_size > 0 (a g_swa given with
      window_size = 0 raises: the branch it weighs is off).

    So the defaults (no g_cmp, window_size = 0) run the selected branch alone, over blocks chosen from the
    mean-pooled keys; pass g_cmp and window_size for the paper's three branches. A missing gate of an active
    branch means weight 1. Gates are [B, T, HQ]; the output is [B, T, HQ, Dv] in q's dtype, with gradients for
    q, k, v and every gate.

    Blocks: selection blocks of l' = block_size tokens (default 64, or with cache= the cache's); compression
    windows of l = compress_block_size tokens (default block_size: fla's form, one block for both) every
    d = compress_stride tokens (default gcd(l, l'): windows that do not overlap wherever l divides l'; the paper's
    NSA is block_size=64, compress_block_size=32, compress_stride=16). d must divide l and l'. A selection block scores the compressed rows it overlaps (`select_blocks`, Eq. 9).

    Serving (a KV cache, `nsa.cache`): `attention(q, cache=cache, ...)` attends over an nsa.KVCache or an
    nsa.PagedKVCache (read through its page table), which brings k, v, k_cmp, v_cmp, kv_lens (its lengths) and
    block_size; the T queries are the last T tokens of each of its sequences (cache.lens counts them: append them
    first). A ragged step, q_lens int [B] in [0, T] (at most each sequence's length): sequence b's queries are
    only the first q_lens[b] rows of q, its last q_lens[b] tokens (0: an idle slot, 1: decode, more: a chunk of
    prefill, all in one batch; `append_to_cache(..., lens=q_lens)` appends the same rows); the rows past them are
    padding, their output 0 and no gradient reaching them. The same from raw arrays: k, v [B, TK, H, D] may
    hold longer sequences than q; the T queries are the last T tokens of sequence b, which has kv_lens[b]
    tokens (int [B], default TK; its keys past them are never read). k_cmp [B, NC, H, Dk] and
    v_cmp [B, NC, H, Dv], a learned compression's (`compression_windows`) or the cache's compressed keys and
    values (NC = ceil(TK / d), as `compress` gives them), replace `compress(k)`, `compress(v)`; given with TK > T
    they need kv_lens; gradients then flow to them instead of through the compression to k and v.

    Context parallelism (`nsa.context`): inside jax.shard_map over a mesh axis that splits the sequence,
    context_axis names that axis: q, k, v, the gates (and k_cmp, v_cmp, block_indices, per-query block_counts
    where given) are the local rows of one sequence of P * T tokens in context_layout: "contiguous" (the default:
    device r holds tokens [r * T, (r + 1) * T), as shard_map splits arrays in sequence order) or "zigzag" (the
    causal work balanced, the inputs reordered by `nsa.context.to_context_layout`); the output is the local rows
    of the unsharded attention, and so are the gradients. Packed sequences: B = 1 and cu_seqlens over the whole
    sequence of P * T tokens (in sequence order, on every device).
    """
    if context_axis is not None:
        _context_refuses(cache=cache, kv_lens=kv_lens, q_lens=q_lens)
        if k is None or v is None:
            raise TypeError("attention with context_axis needs the local keys and values k and v")
        _, (l, d) = _attention_blocks(block_size, compress_block_size, compress_stride)
        counts = None if isinstance(block_counts, int) or block_counts is None else block_counts

        def compressed(keys):  # made once from the whole sequence's keys, where needed and not made locally
            if keys["k_cmp"] is None and (g_cmp is not None or block_indices is None):
                keys["k_cmp"] = compress(keys["k"], block_size=l, stride=d)
            if keys["v_cmp"] is None and g_cmp is not None:
                keys["v_cmp"] = compress(keys["v"], block_size=l, stride=d)
            return keys

        def call(q, **rest):  # rest: the gathered keys, kv_lens and the chunk's rows of the local arrays
            return attention(q, **{"block_counts": block_counts, **rest}, block_size=block_size,
                             compress_block_size=compress_block_size, compress_stride=compress_stride,
                             window_size=window_size, scale=scale, implementation=implementation)

        if cu_seqlens is None and k_cmp is None and v_cmp is None:  # made before k and v are gathered, where it can
            if g_cmp is not None or block_indices is None:
                k_cmp = _compressed_locally(k, context_axis, context_layout, l, d)
            if g_cmp is not None:
                v_cmp = _compressed_locally(v, context_axis, context_layout, l, d)
        keys = dict(k=(k, 1), v=(v, 1), k_cmp=(k_cmp, d), v_cmp=(v_cmp, d))
        local = dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_indices=block_indices)
        if counts is not None:  # per query: sharded like q
            local["block_counts"] = counts
        return _in_context(context_axis, context_layout, q, keys, local, call, implementation,
                           None if cu_seqlens is not None else compressed, cu_seqlens)
    pools = page_table = None  # a paged cache's (k, v, k_cmp, v_cmp) pools of pages, and its page table
    if cache is not None:
        k, v, k_cmp, v_cmp, kv_lens, page_table, (block_size, compress_block_size, compress_stride) = _from_cache(
            cache, (block_size, compress_block_size, compress_stride),
            dict(k=k, v=v, k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=kv_lens))
        if page_table is not None:  # checked as each sequence sees them; gathered only where nothing reads pages
            pools = (k, v, k_cmp, v_cmp)
            k, v, k_cmp, v_cmp = (as_sequences(x, page_table) for x in pools)
    elif k is None or v is None:
        raise TypeError("attention needs the keys and values: k and v, or cache= (an nsa.KVCache or nsa.PagedKVCache)")
    B, T, HQ, H = _checks.qkv(q, k, v)
    for name, g in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
        _checks.gate(name, g, B, T, HQ)
    block_size, compression = _attention_blocks(block_size, compress_block_size, compress_stride)
    window_size = _checks.non_negative_int("window_size", window_size)
    if g_swa is not None and window_size == 0:
        raise ValueError("g_swa was given with window_size = 0: the sliding-window branch it weighs is off; pass "
                         "window_size > 0 to turn it on, or leave g_swa out")
    cu_seqlens = _checks.cu_seqlens(cu_seqlens, B, T)
    _given_compressed(k_cmp, v_cmp, q, k, v, compression, cu_seqlens, kv_lens, needs_values=g_cmp is not None)
    if block_counts is None and block_indices is None:
        raise ValueError("block_counts=None (use every slot of block_indices) needs block_indices")
    if block_indices is not None:
        _checks.block_indices(block_indices, B, T, H)
    if block_counts is not None:  # capped at the slots of block_indices, or at the blocks of the longest sequence
        most = cdiv(k.shape[1], block_size) if block_indices is None else block_indices.shape[-1]
        block_counts = _checks.block_counts(block_counts, B, T, H, most)
    lens_name = "cache.lens" if cache is not None else "kv_lens"
    if q_lens is not None:  # a ragged step
        q_lens, kv_lens = _checks.ragged_lens(q_lens, kv_lens, B, T, k.shape[1], cu_seqlens, lens_name)
        counts = None if block_counts is None or isinstance(block_counts, int) else jnp.broadcast_to(
            jnp.asarray(block_counts, jnp.int32), (B, T, H))
        blocks = dict(block_size=block_size, compress_block_size=compression[0], compress_stride=compression[1])

        def rolled(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, kv_lens, page_table=None, q_lens=None):
            """The ragged step as the ops take it (`_ragged`: rows rolled), over arrays or over the pools of pages of
            page_table (as they are at T = 1, gathered otherwise: the rows past each sequence are zeroed)."""
            per_query = dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_indices=block_indices, block_counts=counts)
            if page_table is not None and T > 1:
                k, v, k_cmp, v_cmp = gathered(page_table, k, v, k_cmp, v_cmp)
            q, k, v, k_cmp, v_cmp, per_query, ops_lens, unroll = _ragged(q, k, v, k_cmp, v_cmp, per_query, q_lens,
                                                                          kv_lens, compression)
            if counts is None:
                per_query["block_counts"] = block_counts
            keys = dict(k=k, v=v, kv_lens=ops_lens, k_cmp=k_cmp, v_cmp=v_cmp)
            if page_table is not None and T == 1:  # a decode step over the pages, as they are
                keys = dict(cache=PagedKVCache(k, v, k_cmp, v_cmp, page_table, ops_lens, **blocks))
            return unroll(attention(q, **keys, **per_query, **blocks, window_size=window_size, scale=scale,
                                    implementation=implementation))

        keys = pools if pools is not None else (k, v, k_cmp, v_cmp)
        if block_indices is not None or g_cmp is None or counts is not None or k_cmp is None or v_cmp is None:
            return rolled(q, *keys, g_cmp, g_slc, g_swa, kv_lens, page_table, q_lens)
        # a serving step: a fused step takes q_lens itself (no roll, nothing of the cache moves); `rolled` otherwise
        q, scale = _scaled(q, scale)
        valid = jnp.arange(T) < q_lens[:, None]
        padding_zeroed = lambda x: None if x is None else jnp.where(
            valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0).astype(x.dtype)
        arrays = Step(padding_zeroed(q), *keys, *map(padding_zeroed, (g_cmp, g_slc, g_swa)), kv_lens, page_table,
                      q_lens)
        static = _statics(block_counts=_slots(block_counts), **blocks, window_size=window_size, scale=scale)
        return _dispatch.decode_step(implementation, static, rolled, arrays)
    kv_lens = _key_lens(kv_lens, q, k, cu_seqlens, lens_name)
    q, scale = _scaled(q, scale)  # a traced scale is folded into q once, for every branch
    windows = dict(block_size=compression[0], stride=compression[1])
    if k_cmp is None and (g_cmp is not None or block_indices is None):
        k_cmp = compress(k, **windows, cu_seqlens=cu_seqlens)
    if g_cmp is not None and v_cmp is None:
        v_cmp = compress(v, **windows, cu_seqlens=cu_seqlens)

    def branches(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, kv_lens, page_table=None, q_lens=None):
        """The output from the branches' ops, one after another (q_lens: a ragged step's, never given here, a Step's
        field). A paged cache's compressed pools are gathered (O(cache / d)); a decode step reads its selected
        blocks and its window through the page table (`paged_selected`, `paged_window`), a longer step gathers the
        whole pools first."""
        if page_table is not None:
            k_cmp, v_cmp = gathered(page_table, k_cmp, v_cmp)
            if T > 1:
                (k, v), page_table = gathered(page_table, k, v), None
        common = dict(scale=scale, cu_seqlens=cu_seqlens, kv_lens=kv_lens, implementation=implementation)
        gated = []
        lse_cmp = None
        if g_cmp is not None:
            o_cmp, lse_cmp = compressed_attention(q, k_cmp, v_cmp, **windows, **common)
            gated.append((g_cmp, o_cmp))
        indices = block_indices
        if indices is None:  # the selection reuses the compressed branch's lse when it has one
            indices = _select(q, k_cmp, lse_cmp, _slots(block_counts), block_size, compression, scale, cu_seqlens,
                              kv_lens, implementation)
        if page_table is None:
            o_slc = selected_attention(q, k, v, indices, block_counts=block_counts, block_size=block_size, **common)
        else:
            o_slc = _paged_selected_attention(q, k, v, indices, block_counts, kv_lens, page_table,
                                              block_size=block_size, scale=scale, implementation=implementation)
        gated.append((g_slc, o_slc))
        if window_size > 0:
            window = (k, v, kv_lens) if page_table is None else paged_window(page_table, k, v, kv_lens, T, window_size)
            if window is None:  # the window spans each sequence's whole capacity
                window = (*gathered(page_table, k, v), kv_lens)
            o_swa = sliding_window_attention(*((q,) + window[:2]), window_size=window_size,
                                             **dict(common, kv_lens=window[2]))
            gated.append((g_swa, o_swa))
        gates, outputs = zip(*gated)
        return _gated_sum(gates, outputs, q.dtype)

    serving = kv_lens is not None and block_indices is None and g_cmp is not None  # maybe a fused step
    if pools is not None and not serving:
        k, v, k_cmp, v_cmp = gathered(page_table, *pools)
    elif pools is not None:  # the fused step reads the pages through the table; the ops gather them (`branches`)
        k, v, k_cmp, v_cmp = pools
    arrays = Step(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, kv_lens, page_table if serving else None)
    if serving:
        static = _statics(block_counts=_slots(block_counts), block_size=block_size, compress_block_size=compression[0],
                          compress_stride=compression[1], window_size=window_size, scale=scale)
        return _dispatch.decode_step(implementation, static, branches, arrays)
    return branches(*arrays)
