"""The platform switch and the per-element map, below every kernel family and the dispatcher.

`platform_dependent` chooses between per-platform implementations when a program is lowered (one lowering per
platform, for programs exported for several platforms at once). `map_leading` runs a function on each element
of its arrays' leading axis: the vmap rule of kernels that have none, and a symbolic batch for kernels that
cannot take one.
"""

import functools

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

# the platforms as platform_dependent names them
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@functools.cache
def has_cuda_gpu():
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this jaxlib, or no GPU
        return False


def platform_name(name):
    """A platform as platform_dependent names it: None is jax's default backend, and 'gpu' (jax's name for both
    CUDA and ROCm) this machine's GPUs, CUDA where it has none."""
    name = jax.default_backend() if name is None else name
    if name == "gpu":
        return "cuda" if has_cuda_gpu() or jax.default_backend() != "gpu" else "rocm"
    return name


def map_leading(fn, args, mapped, *, keep_axis=False):
    """fn(*args) run on each element of the leading axis of the leaves of `args` where `mapped` (a list of bools,
    one per leaf) is True, the other leaves passed whole: a lax.map, each result stacked on a new leading axis.
    With keep_axis each element keeps a leading axis of 1."""
    leaves, tree = jax.tree_util.tree_flatten(args)

    def one(xs):
        xs = iter(xs)
        element = lambda: next(xs)[None] if keep_axis else next(xs)
        return fn(*jax.tree_util.tree_unflatten(tree, [element() if m else x for x, m in zip(leaves, mapped)]))

    return lax.map(one, [x for x, m in zip(leaves, mapped) if m])


def mapped_over_vmap(fn):
    """fn with a vmap rule: jax_triton's triton_call has none. Under vmap the kernel runs once per
    mapped element (lax.map), which also keeps packed sequences (cu_seqlens, B = 1) valid."""

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return fn(*args)

    @batchable.def_vmap
    def rule(axis_size, in_batched, *args):
        out = map_leading(fn, args, jax.tree_util.tree_leaves(in_batched))
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return batchable


def platform_dependent(*args, default, **per_platform):
    """`jax.lax.platform_dependent(*args, default=default, **per_platform)`, made for programs lowered (exported) for
    several platforms at once, and for the kernels' limits to apply only where they run:

    - each branch is lowered for its platform alone. jax's platform_dependent (a cond) lowers the branches it keeps
      for every platform of the program, so that a Pallas TPU kernel is also lowered for the CPU ("Only interpret
      mode is supported on CPU backend") and for CUDA ("Compiler params for platform tpu cannot be used for gpu
      lowering"), and Mosaic GPU's for every platform ("mpmd_map does not support multi-platform lowering");
    - `default` is traced now (it may close over traced values): its results' shapes and dtypes are every branch's,
      and its effects the switch's. The branches of `per_platform` are traced only when the program is lowered for
      their platform: they must not close over traced values nor have effects, and their results must match
      `default`'s (else lowering raises). A program lowered for the CPU never traces the TPU or GPU kernels.
    """
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    flat = lambda fn: lambda *xs: jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, xs)))
    closed, shapes = jax.make_jaxpr(default, return_shape=True)(*args)
    outs = _switch(leaves, closed, tuple((platform, flat(fn)) for platform, fn in per_platform.items()))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)


_switch_p = jex_core.Primitive("nsa_platform_dependent")
_switch_p.multiple_results = True
_switch_p.def_effectful_abstract_eval(lambda *avals, outputs, switch_effects, **_: (outputs, switch_effects))


def _switch(operands, closed, branches):
    """The switch's outputs: on `operands` and the constants of `closed` (the default branch traced on operands;
    its constants may be traced values, hence operands too), with `branches` ((platform, fn of operands), ...)."""
    n = len(operands)
    default = lambda *xs: jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(closed.jaxpr, xs[n:]))(*xs[:n])
    branches = tuple((platform, functools.partial(_first, n, fn)) for platform, fn in branches)
    return _switch_p.bind(*operands, *closed.consts, default=default, branches=branches,
                          outputs=tuple(closed.out_avals), switch_effects=frozenset(closed.effects))


def _first(n, fn, *xs):
    return fn(*xs[:n])


def _switch_batched(args, dims, *, default, branches, **_):
    """vmap: every branch vmapped (the kernels' own rules then apply, `mapped_over_vmap`)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)  # None: not mapped
    vmapped = lambda fn: jax.vmap(fn, in_axes=tuple(dims), axis_size=size)
    outs = _switch(args, jax.make_jaxpr(vmapped(default))(*args),
                   tuple((platform, vmapped(fn)) for platform, fn in branches))
    return outs, [0] * len(outs)


def _switch_eager(*args, default, branches, outputs, **_):
    """Called outside jit: the branch of the platform jax runs it on (its default backend)."""
    platform = platform_name(None)
    return _checked(platform, dict(branches).get(platform, default), outputs)(*args)


def _switch_lowering(platform, ctx, *args, default, branches, outputs, switch_effects):
    """The switch lowered for `platform` (None: one without a rule of its own). Each platform has its own rule, so
    that jax, lowering a program for several, lowers each for that platform alone (mlir.lower_per_platform), and
    what its branch holds (a kernel, another switch) with it."""
    fn = _checked(platform, dict(branches).get(platform, default), outputs)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _checked(platform, fn, outputs):
    """fn, raising TypeError unless its results have the shapes and dtypes `outputs` (the default branch's)."""
    def run(*xs):
        outs = fn(*xs)
        got, want = [(o.shape, o.dtype) for o in outs], [(a.shape, a.dtype) for a in outputs]
        if got != want:
            raise TypeError(f"nsa: the {platform} branch of a platform_dependent returns {got}, its default {want}")
        return outs

    return run


_switch_p.def_impl(_switch_eager)
batching.primitive_batchers[_switch_p] = _switch_batched
mlir.register_lowering(_switch_p, functools.partial(_switch_lowering, None))  # the platforms without a rule


def _register_lowerings():
    for platform in PLATFORMS:
        mlir.register_lowering(_switch_p, functools.partial(_switch_lowering, platform), platform=platform)


_register_lowerings()
