"""A symbolic batch (jax.export shape polymorphism) for kernels that cannot take one in their grid."""

import functools

import jax


def per_sequence(fn):
    """fn(*arrays, **static), or where the batch (axis 0 of the first array) is a symbolic dimension, fn on each
    sequence alone: a lax.map over the arrays whose axis 0 is the batch (the others, such as ranges shared by the
    batch, are passed whole), every result [B, ...]. The kernels then see B = 1 and no symbolic shape: Pallas's
    lowerings take one only in a grid, never in an array a DMA reads whole or a table prefetched into SMEM."""
    @functools.wraps(fn)
    def run(*args, **static):
        leaves, tree = jax.tree_util.tree_flatten(args)
        batch = leaves[0].shape[0]
        if not jax.export.is_symbolic_dim(batch):
            return fn(*args, **static)
        mapped = [x.ndim > 0 and x.shape[0] == batch for x in leaves]

        def one(xs):
            xs = iter(xs)
            sequence = [next(xs)[None] if m else x for x, m in zip(leaves, mapped)]
            results = fn(*jax.tree_util.tree_unflatten(tree, sequence), **static)
            return jax.tree_util.tree_map(lambda y: y[0], results)

        return jax.lax.map(one, [x for x, m in zip(leaves, mapped) if m])

    return run
