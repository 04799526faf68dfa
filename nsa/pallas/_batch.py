"""A symbolic batch (jax.export shape polymorphism) for kernels that cannot take one in their grid."""

import functools

import jax

from nsa._platform import map_leading


def per_sequence(fn):
    """fn(*arrays, **static), or where the batch (axis 0 of the first array) is a symbolic dimension, fn on each
    sequence alone: a lax.map over the arrays whose axis 0 is the batch (the others, such as ranges shared by the
    batch, are passed whole), every result [B, ...]. The kernels then see B = 1 and no symbolic shape: Pallas's
    lowerings take one only in a grid, never in an array a DMA reads whole or a table prefetched into SMEM."""
    @functools.wraps(fn)
    def run(*args, **static):
        leaves = jax.tree_util.tree_leaves(args)
        batch = leaves[0].shape[0]
        if not jax.export.is_symbolic_dim(batch):
            return fn(*args, **static)
        mapped = [x.ndim > 0 and x.shape[0] == batch for x in leaves]
        one = lambda *sequence: jax.tree_util.tree_map(lambda y: y[0], fn(*sequence, **static))
        return map_leading(one, args, mapped, keep_axis=True)

    return run
