"""The shared test base on the Triton kernels (implementation="triton"), run on the CPU in Triton's
interpreter (nsa/triton/interpreter.py). Triton's interpreter has no bfloat16: that dtype runs on the
GPU, where tests/test_triton_gpu.py runs the whole base on the compiled kernels.
"""

import pytest

from tests.base import SMALL_INTERPRETED_BLOCK_CASES, NSATestBase
from tests.conftest import ON_GPU


@pytest.mark.interpreted
@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernels are compiled: tests/test_triton_gpu.py runs the base")
class TestTritonInterpreted(NSATestBase):
    implementation = "triton"
    dtypes = ("float32", "float16")
    interpreted = True
    interpreted_block_cases = SMALL_INTERPRETED_BLOCK_CASES

    # Not here: the transformation tests. In the interpreter a kernel is a jax.pure_callback, not jax-triton's custom
    # call, so jit + grad (and its bitwise repeatability), checkpoint, vmap and shard_map would test, around a
    # callback, the wrappers every family shares, which the XLA and Pallas bases and tests/test_api.py test already
    # (vmap of the Triton kernels themselves: tests/test_triton_selected.py); the GPU base
    # (tests/test_triton_gpu.py::TestTriton) runs them on the compiled kernels. 138 s of a CI worker's time.
    test_jit_grad_and_bitwise_repeatable = test_gradient_under_checkpoint = None
    test_vmap_over_a_leading_axis = test_inside_shard_map = None

    @pytest.fixture(autouse=True)
    def _interpreter(self, interpreted):
        pass
