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

    @pytest.fixture(autouse=True)
    def _interpreter(self, interpreted):
        pass
