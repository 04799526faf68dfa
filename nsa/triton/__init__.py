"""Triton kernels for GPUs, called from JAX through jax-triton (imported only when it is installed).

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals; DTYPES are the input dtypes they take (Triton has no float64). An op missing
here runs the reference on every platform.
"""

import jax.numpy as jnp

from nsa.triton import compressed, select, selected, window

DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

KERNELS = {
    "window": (window.forward, window.backward),
    "compressed": (compressed.forward, compressed.backward),
    "selected": (selected.forward, selected.backward),
    "select": (select.forward, None),
}
