"""Context parallelism: one long sequence over the P devices of a mesh axis.

Inside `jax.shard_map` over a mesh axis that splits the sequence, `nsa.attention(..., context_axis="sp")` gives the
local queries' rows of the unsharded attention, forward and backward, every branch and gate. q, k, v and the gates
arrive sharded alike along T, in a layout of the whole sequence of T = P * T_local tokens:

- "contiguous" (the default): device r holds tokens [r * T / P, (r + 1) * T / P), the rows shard_map gives it
  when the arrays are split along T in sequence order, so no reordering is needed;
- "zigzag" (the causal work balanced: a query attends more compressed rows the later it is, and contiguous gives the
  last device the latest queries): the sequence in 2P chunks of C = T / (2P) tokens; device r holds chunks r and
  2P - 1 - r, in that order. Its gain has not been measured yet (docs/context.md).

Packed sequences (B = 1): `cu_seqlens` over the whole sequence of P * T_local tokens, in sequence order (not the
layout's), the same on every device.

`to_context_layout(x, P, "zigzag")` reorders a [B, T, ...] array so that shard_map's split of its T axis into P
equal parts hands each device its rows; `from_context_layout` undoes it; `context_positions(T, P, "zigzag")` is
each row's global position (RoPE's positions, in the same order). For "contiguous" the three are the identity.

The design (Llama 3's all-gather context parallelism, mdy666's NSA): q stays local; each device compresses its own
chunks (the windows' overhang into the next chunk all-gathered), and the compressed rows are all-gathered (tiny)
apart from k and v, so that the compressed branch and the selection need not wait for k and v; each local chunk of
queries then runs the ops as the last queries of a sequence that ends where the chunk ends (kv_lens): the
selection is local, the window is cut from the gathered keys. The gathered k and v are not kept for the backward:
the step runs under jax.checkpoint, which keeps only its local inputs, so the backward gathers k and v again and
recomputes the forward (one more forward of the attention: measured cost on GPUs still to come). The gradients of
k and v reach each device's own rows through the all-gather's transpose, a reduce-scatter.
"""

import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Layout = Literal["zigzag", "contiguous"]
LAYOUTS = ("zigzag", "contiguous")


def _chunks(layout, P):
    """The number of chunks a sequence is cut into, and the order device 0, 1, ... holds them in."""
    if layout == "contiguous":
        return P, list(range(P))
    return 2 * P, [c for r in range(P) for c in (r, 2 * P - 1 - r)]


def _check(T, P, layout, name="T"):
    if layout not in LAYOUTS:
        raise ValueError(f"context_layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(P, (int, np.integer)) or P < 1:
        raise ValueError(f"the number of devices P must be a positive int, got {P!r}")
    chunks = _chunks(layout, P)[0]
    if T % chunks:
        raise ValueError(f"{name} = {T} tokens must split into {chunks} equal chunks (the {layout!r} layout over "
                         f"P = {P} devices), got {T} % {chunks} = {T % chunks}")


def context_positions(T: int, P: int, layout: Layout = "contiguous") -> np.ndarray:
    """int32 [T]: the global position of each row of a sequence of T tokens in `layout` over P devices (rows
    [r * T / P, (r + 1) * T / P) are device r's): RoPE's positions for the rows as `to_context_layout` orders them."""
    _check(T, P, layout)
    chunks, order = _chunks(layout, P)
    C = T // chunks
    return np.concatenate([np.arange(c * C, (c + 1) * C) for c in order]).astype(np.int32)


def _reorder(x, order, chunks, axis):
    shape = x.shape
    x = x.reshape(shape[:axis] + (chunks, shape[axis] // chunks) + shape[axis + 1:])
    return jnp.take(x, np.asarray(order), axis=axis).reshape(shape)


def to_context_layout(x: jax.Array, P: int, layout: Layout = "contiguous", *, axis: int = 1) -> jax.Array:
    """x [B, T, ...] (T along `axis`) reordered into `layout` over P devices: shard_map's split of that axis into
    P equal parts gives device r its rows (`context_positions`)."""
    _check(x.shape[axis], P, layout, f"x.shape[{axis}]")
    chunks, order = _chunks(layout, P)
    return _reorder(x, order, chunks, axis)


def from_context_layout(x: jax.Array, P: int, layout: Layout = "contiguous", *, axis: int = 1) -> jax.Array:
    """The inverse of `to_context_layout`: x in `layout` over P devices back in sequence order."""
    _check(x.shape[axis], P, layout, f"x.shape[{axis}]")
    chunks, order = _chunks(layout, P)
    return _reorder(x, np.argsort(order), chunks, axis)


def num_devices(axis_name: str) -> int:
    """P, the size of mesh axis `axis_name` (a context_axis) of the jax.shard_map the caller runs inside; ValueError
    outside one (where JAX raises NameError: unbound axis name)."""
    try:
        return lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(f"context_axis = {axis_name!r} must name a mesh axis of the jax.shard_map the op runs inside, "
                         f"the axis that splits the sequence, but no such axis is bound here: call the op inside "
                         f"jax.shard_map(..., mesh=mesh, in_specs=P(None, {axis_name!r}), out_specs=P(None, "
                         f"{axis_name!r})) over a mesh with that axis (docs/context.md), or leave context_axis out"
                         ) from error


def check_local(T_local: int, P: int, layout: Layout):
    """ValueError unless a device's T_local rows split into its chunks of `layout` over P devices."""
    _check(T_local * P, P, layout, f"the sequence of P * T = {P} * {T_local}")


def local_chunks(T_local: int, P: int, r, layout: Layout):
    """The chunks of device r's T_local rows: [(first row, rows, global end)] (r traced: the axis index), the
    global end being the position one past the chunk's last token. Over P = 1 device both layouts are the sequence
    in order: one chunk."""
    if layout == "contiguous" or P == 1:
        return [(0, T_local, (r + 1) * T_local)]
    C = T_local // 2
    return [(0, C, (r + 1) * C), (C, C, (2 * P - r) * C)]


def gathered(x: Optional[jax.Array], axis_name: str, layout: Layout) -> Optional[jax.Array]:
    """x [B, T_local, ...], sharded along its rows over mesh axis `axis_name` in `layout`: all of it [B, T, ...] in
    sequence order (an all-gather). Its gradient is the reduce-scatter of the whole sequence's, summed in float32
    (`_gather`)."""
    if x is None:
        return None
    return from_context_layout(_gather(x, axis_name), lax.axis_size(axis_name), layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(x, axis_name):
    """lax.all_gather of x [B, T_local, ...] along its rows; the transpose reduce-scatters the cotangent in float32
    (P devices' bf16 gradients of k and v summed without rounding between them), then casts it to x's dtype."""
    return lax.all_gather(x, axis_name, axis=1, tiled=True)


def _gather_fwd(x, axis_name):
    return _gather(x, axis_name), None


def _gather_bwd(axis_name, _, cotangent):
    acc = jnp.promote_types(cotangent.dtype, jnp.float32)
    summed = lax.psum_scatter(cotangent.astype(acc), axis_name, scatter_dimension=1, tiled=True)
    return (summed.astype(cotangent.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)
