"""nsa/triton/interpreter.py, the shim that runs the Triton kernels in Triton's interpreter: a mask that joins a
scalar comparison to a block one (`(blk >= 0) & (j < BS)`, as the selected and decode kernels build them) loads
and stores as on the GPU. Triton's interpreter types a comparison's handle with its operands' type, so such a
mask was int32, which Triton 3.9's interpreter refuses ("mask has unsupported dtype"); CI runs this file under
Triton 3.9 too (.ci/run).
"""

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from nsa.triton import interpreter


@triton.jit
def _copy_from_program_one(X, O, N: tl.constexpr, NP: tl.constexpr):
    """Row program_id(0) of O [programs, NP]: X [N] plus one from program 1 on (one past N), nothing from
    program 0; each mask joins the scalar comparison p >= 1 to a block one, on either side."""
    p = tl.program_id(0)
    offs = tl.arange(0, NP)
    x = tl.load(X + offs, mask=(p >= 1) & (offs < N), other=0.0)
    tl.store(O + p * NP + offs, x + 1.0, mask=(offs < NP) & (p >= 1))


def test_masks_joining_a_scalar_comparison(interpreted):
    x = jnp.arange(5, dtype=jnp.float32) * 2.0
    o = interpreter.interpret_call(x, kernel=_copy_from_program_one, out_shape=jax.ShapeDtypeStruct((3, 8), x.dtype),
                                   grid=(3,), zeroed_outputs=(0,), N=5, NP=8)
    row = np.concatenate([np.asarray(x), np.zeros(3, np.float32)]) + 1.0
    np.testing.assert_array_equal(np.asarray(o), np.stack([np.zeros(8, np.float32), row, row]))


def test_outputs_not_zeroed_start_undefined(interpreted):
    """As on the GPU, only the outputs named in zeroed_outputs start at zero: program 0's row, which it never
    writes, reads NaN otherwise (so a kernel that relies on a zeroed output it did not ask for fails here too)."""
    x = jnp.arange(5, dtype=jnp.float32)
    o = interpreter.interpret_call(x, kernel=_copy_from_program_one, out_shape=jax.ShapeDtypeStruct((2, 8), x.dtype),
                                   grid=(2,), N=5, NP=8)
    assert np.isnan(np.asarray(o)[0]).all() and not np.isnan(np.asarray(o)[1]).any()
