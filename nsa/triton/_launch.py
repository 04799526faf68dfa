"""The one place where nsa's Triton kernels are launched from JAX.

Every kernel goes through `triton_call`, which is jax_triton.triton_call on a GPU. The CPU tests
replace `_call` with a launcher that runs the same kernel in Triton's interpreter (TRITON_INTERPRET=1)
through jax.pure_callback (tests/triton_interpreter.py), so the kernel bodies are tested in CI.
"""

import jax


def _call(*args, **kwargs):
    import jax_triton  # imported here: it fails to import on a CPU-only jaxlib

    return jax_triton.triton_call(*args, **kwargs)


def _varying(x):
    """The manual mesh axes (inside shard_map) along which x varies; empty outside shard_map."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if axis_type is None else axis_type.varying


def triton_call(*args, **kwargs):
    """jax_triton.triton_call: arrays and scalars positionally, then the kernel's keywords.

    Inside shard_map the outputs vary along every mesh axis an input varies along (the kernel's
    outputs are typed as replicated otherwise, and custom_vjp then rejects the gradients).
    """
    axes = frozenset().union(*(_varying(a) for a in args if isinstance(a, jax.Array)))
    return jax.tree_util.tree_map(lambda o: _vary(o, axes), _call(*args, **kwargs))


def _vary(x, axes):
    missing = tuple(sorted(axes - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def shape_dtype(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)
