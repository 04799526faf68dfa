"""The one place where nsa's Triton kernels are launched from JAX.

Every kernel goes through `launch`, which calls jax_triton.triton_call on a GPU. On the CPU,
`nsa.triton.interpreter.interpreted()` replaces `_call` with a launcher that runs the same kernel in
Triton's interpreter (TRITON_INTERPRET=1) through jax.pure_callback: the CPU tests (so the kernel bodies
are tested in CI) and the kernels notebook.
"""

import functools
import math

import jax
import jax.numpy as jnp


def _jax_triton_call(*args, **kwargs):
    import jax_triton  # imported here: it fails to import on a CPU-only jaxlib

    return jax_triton.triton_call(*args, **kwargs)


_call = _jax_triton_call  # what `launch` calls: nsa.triton.interpreter replaces it while it is active


@functools.cache
def jax_triton_error():
    """Why jax_triton does not import in this process (a sentence), or None."""
    try:
        import jax_triton  # noqa: F401  (the GPU path's only extra dependency)
    except Exception as e:  # ImportError, or a jax_triton that does not match this jax
        return f"jax-triton does not import ({type(e).__name__}: {e})"
    return None


def missing():
    """Why `launch` cannot run a kernel in this process, or None: always None while the interpreter launches them."""
    return None if _call is not _jax_triton_call else jax_triton_error()


def _varying(x):
    """The manual mesh axes (inside shard_map) along which x varies; empty outside shard_map."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if axis_type is None else axis_type.varying


def _vary(x, axes):
    missing = tuple(sorted(axes - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def launch(kernel, *, grid, inputs, outputs, num_warps, num_stages, zeroed=(), **constexprs):
    """Runs `kernel` on the grid; returns its outputs, a tuple in the kernel's argument order.

    The kernel's pointer arguments (those not given in `constexprs`) are its inputs, then its outputs;
    each is passed by its name in the kernel's signature, `inputs` {name: array} and `outputs` {name:
    jax.ShapeDtypeStruct}, so that two arrays can never be swapped (a missing or unknown name raises).
    The outputs named in `zeroed` hold zeros when the kernel starts (jax_triton's zeroed_outputs: a memset in
    the same custom call, e.g. the counters of the last program of a split); the others start undefined.
    A grid of no programs (no key tile, no query) launches nothing: its outputs, empty, are zeros.
    Inside shard_map the outputs vary along every mesh axis an input varies along (the kernel's outputs
    are typed as replicated otherwise, and custom_vjp then rejects the gradients).
    """
    pointers = [name for name in kernel.arg_names if name not in constexprs]
    order = [name for name in pointers if name in inputs] + [name for name in pointers if name in outputs]
    if order != pointers or len(pointers) != len(inputs) + len(outputs):
        raise TypeError(f"{kernel.fn.__name__} takes the arrays {pointers} (inputs, then outputs), got inputs "
                        f"{list(inputs)} and outputs {list(outputs)}")
    out_names = [name for name in pointers if name in outputs]
    shapes = [outputs[name] for name in out_names]
    if math.prod(grid) == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
    args = [inputs[name] for name in pointers if name in inputs]
    axes = frozenset().union(*(_varying(a) for a in args if isinstance(a, jax.Array)))
    unknown = set(zeroed) - set(out_names)
    if unknown:
        raise TypeError(f"{kernel.fn.__name__}: zeroed names {sorted(unknown)}, not among its outputs {out_names}")
    results = _call(*args, kernel=kernel, out_shape=shapes, grid=grid, num_warps=num_warps, num_stages=num_stages,
                    zeroed_outputs=tuple(i for i, name in enumerate(out_names) if name in zeroed), **constexprs)
    return tuple(_vary(r, axes) for r in results)


def shape_dtype(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)
