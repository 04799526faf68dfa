"""The XLA reference of every NSA op: readable, memory-lean, and the contract every kernel meets.

`OPS` maps each op to its (forward, backward) pair. A forward takes the op's arrays positionally and
its static configuration as keywords, and returns (outputs, residuals); a backward takes
(residuals, cotangents) and the same keywords and returns one gradient per array (None for integer
arrays). Kernels in nsa.triton and nsa.pallas implement the same pairs with the same residuals.
"""

from nsa.reference import compress, compressed, select, selected, window

OPS = {
    "compress": (compress.forward, compress.backward),
    "compressed": (compressed.forward, compressed.backward),
    "select": (select.forward, None),
    "selected": (selected.forward, selected.backward),
    "window": (window.forward, window.backward),
}
