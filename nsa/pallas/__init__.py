"""Pallas kernels for TPUs.

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals; DTYPES are the input dtypes they take. Empty until the kernels land: every op
then runs the reference. `_flash` (the window and compressed branches' forward and backward) is written
and tested; the ops that use it join KERNELS with the dispatch to interpret mode and Mosaic.
"""

import jax.numpy as jnp

KERNELS = {}
DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
