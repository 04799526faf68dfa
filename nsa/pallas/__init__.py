"""Pallas kernels for TPUs.

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals. Empty until the kernels land: every op then runs the reference.
"""

KERNELS = {}
