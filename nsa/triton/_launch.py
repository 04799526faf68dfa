"""The one place where nsa's Triton kernels are launched from JAX.

Every kernel goes through `triton_call`, which is jax_triton.triton_call on a GPU. The CPU tests
replace it with a launcher that runs the same kernel in Triton's interpreter (TRITON_INTERPRET=1)
through jax.pure_callback (tests/triton_interpreter.py), so the kernel bodies are tested in CI.
"""

import jax


def triton_call(*args, **kwargs):
    """jax_triton.triton_call: arrays and scalars positionally, then the kernel's keywords."""
    import jax_triton  # imported here: it fails to import on a CPU-only jaxlib

    return jax_triton.triton_call(*args, **kwargs)


def shape_dtype(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)
