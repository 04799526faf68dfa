"""Test-wide setup: on a CPU-only jax, Triton kernels run in Triton's interpreter; on a GPU, float32
matmuls run in full precision so the XLA reference stays a reference.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports nsa.triton. The `interpreted` fixture routes implementation="triton" to the interpreted
kernels for one test (tests/triton_interpreter.py).
"""

import os

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
if ON_GPU:  # float32 matmuls of the XLA reference would otherwise run in TF32 (about 4e-4 error)
    jax.config.update("jax_default_matmul_precision", "highest")
else:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def interpreted(monkeypatch):
    if ON_GPU:  # the kernels are compiled for the GPU there, not for the interpreter
        pytest.skip("the interpreter tests run on a CPU-only jax")
    from tests import triton_interpreter

    triton_interpreter.install(monkeypatch)
