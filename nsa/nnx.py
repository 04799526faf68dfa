"""A ready-made NSA layer for Flax NNX: `NativeSparseAttention`, in the spirit of fla's.

    from flax import nnx
    from nsa.nnx import NativeSparseAttention

    layer = NativeSparseAttention(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                                  block_size=64, block_counts=16, window_size=512, rngs=nnx.Rngs(0))
    y = layer(x)                                          # x, y [B, T, hidden_size]

    y, cache = layer.prefill(prompts, capacity=N, lens=lens)  # right-padded prompts [B, TP, hidden_size]
    y, cache = layer.step(x_new, cache)                   # x_new [B, TN, hidden_size]: TN new tokens each
    y, cache = layer.step(x_new, cache, lens=n)           # a ragged step: n[b] <= TN new tokens of sequence b

The layer holds the projections and calls `nsa.attention`; everything else stays in plain functions. The KV
cache (`nsa.KVCache`, or `nsa.PagedKVCache` from `init_paged_cache`) lives outside the layer: passed in and returned, so a decode step is a pure function
that jits with the cache donated. Needs flax (`pip install '.[nnx]'` from a checkout); `import nsa` never imports this
module.
"""

import functools
import math
import numbers

import jax
import jax.numpy as jnp

try:
    from flax import nnx
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(f"nsa.nnx needs flax >= 0.12 ({error}): install nsa's nnx extra, from a checkout of nsa "
                              f"pip install '.[nnx]' (or pip install 'flax>=0.12')", name=error.name) from error

from nsa import _checks, context
from nsa.api import attention, compression_windows
from nsa.cache import append_to_cache, check_cache, empty_cache, empty_paged_cache, prefill_cache


class NativeSparseAttention(nnx.Module):
    """Native Sparse Attention (DeepSeek, arXiv 2502.11089) with its projections: [B, T, C] -> [B, T, C].

    Shapes: x [B, T, C] (C = hidden_size), q [B, T, HQ, Dk], k [B, T, H, Dk], v [B, T, H, Dv], one gate
    [B, T, HQ] per branch, attention output [B, T, HQ, Dv]; HQ = num_heads query heads share
    H = num_kv_heads KV heads in groups of G = HQ / H (GQA), Dk = head_dim, Dv = head_dim_v.

    - q, k, v = q_proj(x), k_proj(x), v_proj(x) (with a bias iff qkv_bias), split into heads; with
      rope_theta, q and k get rotary position embeddings (the half-split layout of fla and Llama: dimension
      i rotates with i + Dk / 2, at frequency rope_theta ** (-2 i / Dk));
    - the gates are sigmoid(g_proj(x)), one per query head and branch (the paper's gating), g_proj's output
      laid out [HQ, branches] as fla's: the compressed branch (g_cmp), the selected branch (g_slc, the
      `block_counts` blocks of `block_size` tokens with the highest compressed scores) and, for
      window_size > 0, the sliding window (g_swa);
    - y = o_proj(nsa.attention(q, k, v, g_cmp=..., g_slc=..., g_swa=..., ...)), no bias.

    Arguments (keyword-only): hidden_size; num_heads; num_kv_heads (default num_heads); head_dim (default
    hidden_size / num_heads); head_dim_v (default head_dim); qkv_bias (False); block_size (64: the selection
    block l'); compress_block_size and compress_stride (the compression's windows of l tokens every d, mean-pooled
    unless phi_k, phi_v (below); None: l = block_size, d = gcd(l, block_size) as nsa.attention's; the paper's
    l = 32, d = 16 under l' = 64); block_counts (16); window_size (512; 0 turns
    the sliding window off); rope_theta (10000.0; None: no position embedding); dtype (the computation's dtype, None: from the inputs and parameters) and
    param_dtype (float32), as nnx.Linear takes them; implementation (nsa's: None picks the best for the
    platform, or "xla", "triton", "pallas"); rngs (nnx.Rngs, for the initial weights).

    A learned compression (the paper's phi, Eq. 7), instead of the windows' means: phi_k and phi_v, callables
    (nnx Modules, whose weights train with the layer's; pass one twice to share it) from windows
    [B, NC, l, H, D] to compressed rows [B, NC, H, D], D = Dk for phi_k and Dv for phi_v. `__call__` applies them
    to `nsa.compression_windows` of k and v and passes the rows to nsa.attention as k_cmp, v_cmp; `prefill` and
    `step` hand them to the cache (`prefill_cache` / `append_to_cache`'s phi), which writes phi's row of each
    window once it is complete, so decoding gives what `__call__` gives.

    Context parallelism: context_axis names a mesh axis that splits the sequence (`__call__` inside jax.shard_map:
    x is the device's rows of one sequence in context_layout, "contiguous" (the default) or "zigzag", as nsa.attention's
    context_axis and context_layout; the default positions are the rows' places in the whole sequence, as
    `nsa.context.context_positions` gives them, and cu_seqlens packs the whole sequence). Not with phi over
    overlapping windows (compress_block_size > compress_stride: a device's windows would reach into the next
    device's chunk; ValueError), and not in `prefill` or `step` (a KV cache holds whole sequences; ValueError).

    Serving: `init_cache` (or `init_paged_cache`), `prefill` and `step` take and return an nsa.KVCache (or
    nsa.PagedKVCache) made with this layer's blocks. Jit them (an eager call dispatches nsa's ops one by one), the cache donated:

        graphdef, state = nnx.split(layer)
        step = jax.jit(lambda state, x, cache: nnx.merge(graphdef, state).step(x, cache), donate_argnums=2)
    """

    def __init__(self, *, hidden_size, num_heads, num_kv_heads=None, head_dim=None, head_dim_v=None,
                 qkv_bias=False, block_size=64, compress_block_size=None, compress_stride=None, block_counts=16,
                 window_size=512, rope_theta=10000.0, dtype=None, param_dtype=jnp.float32, implementation=None,
                 phi_k=None, phi_v=None, context_axis=None, context_layout="contiguous", rngs):
        C = self.hidden_size = _checks.positive_int("hidden_size", hidden_size)
        HQ = self.num_heads = _checks.positive_int("num_heads", num_heads)
        H = self.num_kv_heads = HQ if num_kv_heads is None else _checks.positive_int("num_kv_heads", num_kv_heads)
        if HQ % H:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads (GQA), got num_heads = {HQ}, "
                             f"num_kv_heads = {H}")
        Dk = self.head_dim = _default_head_dim(C, HQ) if head_dim is None else _checks.positive_int("head_dim", head_dim)
        Dv = self.head_dim_v = Dk if head_dim_v is None else _checks.positive_int("head_dim_v", head_dim_v)
        self.block_size = _checks.positive_int("block_size", block_size)
        self.compress_block_size, self.compress_stride = _checks.compression(self.block_size, compress_block_size,
                                                                             compress_stride)
        self.block_counts = _checks.positive_int("block_counts", block_counts)
        self.window_size = _checks.non_negative_int("window_size", window_size)
        self.rope_theta = _rope_theta(rope_theta, Dk)
        self.implementation = _checks.implementation(implementation)
        self.phi_k, self.phi_v = _phis(phi_k, phi_v)
        self.context_axis, self.context_layout = _context(context_axis, context_layout, self.phi_k is not None,
                                                          self.compress_block_size, self.compress_stride)
        self.dtype, self.param_dtype = dtype, param_dtype
        self.branches = ("g_cmp", "g_slc", "g_swa") if self.window_size else ("g_cmp", "g_slc")
        linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(C, HQ * Dk, use_bias=qkv_bias)
        self.k_proj = linear(C, H * Dk, use_bias=qkv_bias)
        self.v_proj = linear(C, H * Dv, use_bias=qkv_bias)
        self.g_proj = linear(C, HQ * len(self.branches), use_bias=False)
        self.o_proj = linear(HQ * Dv, C, use_bias=False)

    def __call__(self, x, *, cu_seqlens=None, positions=None):
        """Causal NSA over whole sequences: x [B, T, C] -> y [B, T, C].

        cu_seqlens int [N + 1] (B = 1): N sequences packed along T, none seeing another. positions int
        [B, T]: each token's position for the rotary embedding (default: its index in its sequence).
        """
        return self._whole(x, cu_seqlens, positions)[0]

    def init_cache(self, batch_size, capacity, *, dtype=None):
        """An empty nsa.KVCache for `batch_size` sequences of up to `capacity` tokens, in `dtype` (default:
        the layer's dtype, else its param_dtype), which must be the dtype of the layer's k and v."""
        return empty_cache(batch_size, capacity, self.num_kv_heads, self.head_dim, **self._blocks(),
                           head_dim_v=self.head_dim_v, dtype=_first_given(dtype, self.dtype, self.param_dtype))

    def init_paged_cache(self, num_pages, page_size, batch_size, max_pages, *, dtype=None):
        """An empty nsa.PagedKVCache: a pool of `num_pages` pages of `page_size` tokens for `batch_size` sequences
        of up to `max_pages` pages each (its page table -1: no page, the caller's to fill), in `dtype` as
        `init_cache`'s."""
        return empty_paged_cache(num_pages, page_size, batch_size, max_pages, self.num_kv_heads, self.head_dim,
                                 **self._blocks(), head_dim_v=self.head_dim_v,
                                 dtype=_first_given(dtype, self.dtype, self.param_dtype))

    def prefill(self, x, *, capacity, lens=None):
        """The prompts x [B, TP, C], right-padded (sequence b holds its first lens[b] tokens, int [B],
        default TP), through the layer: (y [B, TP, C] as `__call__` gives it, a cache of capacity N =
        `capacity` holding each sequence's keys and values). y past a prompt's length is padding."""
        self._serving("prefill")
        y, k, v = self._whole(x)
        return y, prefill_cache(k, v, **self._blocks(), capacity=capacity, lens=lens, phi=self._phi())

    def step(self, x, cache, *, lens=None):
        """New tokens of each sequence, x [B, TN, C], at positions cache.lens[b] ... : their keys and values are
        appended to the cache (contiguous or paged), and they attend to everything it holds. Returns (y [B, TN, C],
        the cache with them). One token each is a decode step; more is chunked prefill; lens int [B] (default TN)
        makes it ragged: sequence b's new tokens are only its first lens[b] rows of x (0: an idle slot), and y is 0
        past them (`nsa.attention`'s q_lens)."""
        self._serving("step")
        B, TN = self._check_input(x)
        check_cache(cache, *self._blocks().values())  # a cache made with this layer's blocks
        if cache.lens.shape != (B,):
            raise ValueError(f"cache must hold the B = {B} sequences of x (x.shape[0]), got a cache of "
                             f"{cache.lens.shape[0]} (cache.lens.shape = {tuple(cache.lens.shape)}): make it for this "
                             f"batch (init_cache(batch_size={B}, ...), init_paged_cache or prefill)")
        q, k, v, gates = self._project(x, cache.lens[:, None] + jnp.arange(TN))
        cache = append_to_cache(cache, k, v, lens=lens, phi=self._phi())
        o = attention(q, cache=cache, q_lens=lens, **gates, **self._sparsity())
        return self._output(o), cache

    def _whole(self, x, cu_seqlens=None, positions=None):
        """(y, k, v) of whole sequences x [B, T, C], as `__call__` describes them."""
        B, T = self._check_input(x)
        tokens = jnp.arange(T, dtype=jnp.int32)  # each row's index in the whole (packed) sequence
        if self.context_axis is None:
            cu_seqlens = _checks.cu_seqlens(cu_seqlens, B, T)
        else:  # the device's rows of a sequence split over the axis (nsa.attention checks cu_seqlens over it)
            P = context.num_devices(self.context_axis)
            chunks = context.local_chunks(T, P, jax.lax.axis_index(self.context_axis), self.context_layout)
            tokens = jnp.concatenate([end - rows + jnp.arange(rows, dtype=jnp.int32) for _, rows, end in chunks])
        if positions is None:
            positions = _positions(B, tokens, cu_seqlens)
        else:
            _checks.integer_array("positions", positions, 2)
            _checks.shape("positions", positions, (B, T), "[B, T] (B, T from x)")
        q, k, v, gates = self._project(x, positions)
        learned = {}
        if self.phi_k is not None:  # phi's rows of the windows, in place of their means
            if self.context_axis is not None and cu_seqlens is not None:
                raise ValueError("phi_k, phi_v with context_axis cannot take cu_seqlens: packed, a sequence's "
                                 "compressed rows are not split over the devices as its tokens are")
            windows = lambda y: compression_windows(y, block_size=self.compress_block_size,
                                                    stride=self.compress_stride, cu_seqlens=cu_seqlens)[0]
            learned = dict(k_cmp=self.phi_k(windows(k)), v_cmp=self.phi_v(windows(v)))
        o = attention(q, k, v, **gates, **learned, cu_seqlens=cu_seqlens, context_axis=self.context_axis,
                      context_layout=self.context_layout, **self._sparsity())
        return self._output(o), k, v

    def _check_input(self, x):
        _checks.array("x", x, 3)
        if x.shape[2] != self.hidden_size:
            raise ValueError(f"x must have shape [B, T, hidden_size = {self.hidden_size}], got {tuple(x.shape)}")
        return x.shape[:2]

    def _project(self, x, positions):
        """q [B, T, HQ, Dk], k [B, T, H, Dk], v [B, T, H, Dv] and the gates {name: [B, T, HQ]} of x."""
        B, T = x.shape[:2]
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim_v)
        if self.rope_theta is not None:
            q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        g = jax.nn.sigmoid(self.g_proj(x)).reshape(B, T, self.num_heads, len(self.branches))
        return q, k, v, {name: g[..., i] for i, name in enumerate(self.branches)}

    def _phi(self):
        """The cache's phi: None (the windows' means), or (phi_k, phi_v)."""
        return None if self.phi_k is None else (self.phi_k, self.phi_v)

    def _serving(self, method):
        if self.context_axis is not None:
            raise ValueError(f"{method} serves through a KV cache, which context parallelism does not take: this layer "
                             f"was made with context_axis = {self.context_axis!r}; serve with a layer made without it "
                             f"(the same weights: nnx.update(layer, nnx.state(trained)))")

    def _blocks(self):
        """The selection block and the compression's windows, as nsa's ops and caches take them."""
        return dict(block_size=self.block_size, compress_block_size=self.compress_block_size,
                    compress_stride=self.compress_stride)

    def _sparsity(self):
        return dict(**self._blocks(), block_counts=self.block_counts, window_size=self.window_size,
                    implementation=self.implementation)

    def _output(self, o):
        """o_proj of the attention output o [B, T, HQ, Dv]: [B, T, C]."""
        return self.o_proj(o.reshape(*o.shape[:2], self.num_heads * self.head_dim_v))


def rotary(x, positions, theta):
    """Rotary position embedding of x [B, T, heads, D] at positions int [B, T]: dimension i and i + D / 2
    rotate together by the angle position * theta ** (-2 i / D) (computed in float32, returned in x's dtype)."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None].astype(jnp.float32) * frequencies  # [B, T, 1, D / 2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _positions(B, t, cu_seqlens=None):
    """int32 [B, T]: the index in its sequence of each token t int32 [T] of a (packed) sequence (packed sequences
    restart at cu_seqlens[i])."""
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        t = t - cu[jnp.searchsorted(cu, t, side="right") - 1]  # the start of the sequence holding t
    return jnp.broadcast_to(t, (B, t.shape[0]))


def _phis(phi_k, phi_v):
    """(phi_k, phi_v), both callables or both None."""
    if (phi_k is None) != (phi_v is None):
        given, missing = ("phi_k", "phi_v") if phi_v is None else ("phi_v", "phi_k")
        raise ValueError(f"{given} was given without {missing}: a learned compression needs both (the keys' and the "
                         f"values'; pass one module twice to share it), or neither (the windows' means)")
    for name, phi in (("phi_k", phi_k), ("phi_v", phi_v)):
        if phi is not None and not callable(phi):
            raise TypeError(f"{name} must be a callable (an nnx Module) from windows [B, NC, l, H, D] to rows "
                            f"[B, NC, H, D], got {type(phi).__name__}")
    return phi_k, phi_v


def _context(axis, layout, learned, l, d):
    """(context_axis, context_layout), checked: a layout of nsa.context's, and no phi over overlapping windows."""
    if axis is None:
        return None, layout
    if layout not in context.LAYOUTS:
        raise ValueError(f"context_layout must be one of {context.LAYOUTS}, got {layout!r}")
    if learned and l > d:
        raise ValueError(f"phi_k, phi_v with context_axis need windows that do not overlap (compress_block_size = "
                         f"compress_stride), got compress_block_size = {l} > compress_stride = {d}: each device's "
                         f"windows would reach {l - d} tokens into the next chunk of the sequence, held by another "
                         f"device, and phi's rows of them cannot be made locally")
    return axis, layout


def _first_given(*values):
    return next(value for value in values if value is not None)


def _default_head_dim(hidden_size, num_heads):
    if hidden_size % num_heads:
        raise ValueError(f"head_dim=None takes hidden_size / num_heads, which needs hidden_size a multiple of "
                         f"num_heads, got hidden_size = {hidden_size}, num_heads = {num_heads}; pass head_dim")
    return hidden_size // num_heads


def _rope_theta(theta, head_dim):
    """rope_theta as a float (None: no rotary embedding): finite, > 0, and head_dim even."""
    if theta is None:
        return None
    if not isinstance(theta, numbers.Real) or isinstance(theta, bool):
        raise TypeError(f"rope_theta must be a number or None, got {type(theta).__name__}")
    if not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta must be a finite number > 0 or None, got {theta}")
    if head_dim % 2:
        raise ValueError(f"rope_theta needs an even head_dim (dimensions rotate in pairs), got head_dim = {head_dim}")
    return float(theta)
