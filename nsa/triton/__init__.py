"""Triton kernels for GPUs, called from JAX through jax-triton (imported only when it is installed).

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals. An op missing here runs the reference on every platform.
"""

from nsa.triton import compressed, select, selected, window

KERNELS = {
    "window": (window.forward, window.backward),
    "compressed": (compressed.forward, compressed.backward),
    "selected": (selected.forward, selected.backward),
    "select": (select.forward, None),
}
