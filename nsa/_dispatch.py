"""One custom_vjp for every op, and the choice of the code that runs it.

`apply(op, implementation, static, arrays)` runs op's forward on `arrays` (a tuple; differentiable
arrays and integer arrays alike) with the hashable `static` configuration (a tuple of (name, value)
pairs). Forward and backward each go through `_choose`:

- implementation="xla": the reference (nsa.reference);
- implementation="triton" / "pallas": that kernel, or an error if it does not exist here;
- implementation=None: `jax.lax.platform_dependent` between the kernels that exist (Triton on cuda,
  Pallas on tpu) and the reference everywhere else.

platform_dependent traces every branch, so a Triton branch is only built when jax_triton imports
(it does not on a CPU-only jaxlib).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nsa import reference

_PLATFORMS = {"triton": "cuda", "pallas": "tpu"}


def _kernels(implementation):
    """The kernel table {op: (forward, backward)} of 'triton' or 'pallas', or None if unavailable."""
    if implementation == "triton":
        try:
            import jax_triton  # noqa: F401  (the GPU path's only extra dependency)
        except ImportError:
            return None
        from nsa.triton import KERNELS
        return KERNELS
    from nsa.pallas import KERNELS
    return KERNELS


def _kernel(op, phase, implementation):
    table = _kernels(implementation)
    if table is None or op not in table:
        return None
    return table[op][phase]


def _mapped_over_vmap(fn):
    """fn with a vmap rule: jax_triton's triton_call has none. Under vmap the kernel runs once per
    mapped element (lax.map), which also keeps packed sequences (cu_seqlens, B = 1) valid."""

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return fn(*args)

    @batchable.def_vmap
    def rule(axis_size, in_batched, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        batched = jax.tree_util.tree_leaves(in_batched)
        mapped = [x for x, b in zip(leaves, batched) if b]

        def one(xs):
            xs = iter(xs)
            return fn(*jax.tree_util.tree_unflatten(tree, [next(xs) if b else x for x, b in zip(leaves, batched)]))

        out = lax.map(one, mapped)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return batchable


def _choose(op, phase, implementation, static):
    """The function (*args) -> result that computes `phase` (0 forward, 1 backward) of `op`."""
    static = dict(static)
    ref = functools.partial(reference.OPS[op][phase], **static)
    if implementation == "xla":
        return ref
    if implementation is not None:
        kernel = _kernel(op, phase, implementation)
        if kernel is None:
            needs = " (it needs jax-triton and a CUDA jaxlib)" if implementation == "triton" else ""
            raise NotImplementedError(
                f"implementation={implementation!r} has no kernel for {op!r} here{needs}; "
                f"use implementation=None or 'xla'")
        return _mapped_over_vmap(functools.partial(kernel, **static))
    kernels = {}
    for name, platform in _PLATFORMS.items():
        kernel = _kernel(op, phase, name)
        if kernel is not None:
            kernels[platform] = _mapped_over_vmap(functools.partial(kernel, **static))
    if not kernels:
        return ref
    return lambda *args: lax.platform_dependent(*args, default=ref, **kernels)


def _as_jax(arrays):
    return jax.tree_util.tree_map(jnp.asarray, arrays)


def run(op, implementation, static, arrays):
    """Runs the forward of an op that has no gradient and no residuals (select)."""
    return _choose(op, 0, implementation, static)(*_as_jax(arrays))


def apply(op, implementation, static, arrays):
    """Runs op as a custom_vjp: differentiable in every floating array of `arrays`."""
    return _apply(op, implementation, static, _as_jax(arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _apply(op, implementation, static, arrays):
    return _choose(op, 0, implementation, static)(*arrays)[0]


def _apply_fwd(op, implementation, static, arrays):
    return _choose(op, 0, implementation, static)(*arrays)


def _apply_bwd(op, implementation, static, residuals, cotangents):
    return (tuple(_choose(op, 1, implementation, static)(residuals, cotangents)),)


_apply.defvjp(_apply_fwd, _apply_bwd)
