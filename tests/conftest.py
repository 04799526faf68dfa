"""Test-wide setup: on a CPU-only jax, Triton kernels run in Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports nsa.triton. The `interpreted` fixture routes implementation="triton" to the interpreted
kernels for one test (tests/triton_interpreter.py).
"""

import os

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def interpreted(monkeypatch):
    if ON_GPU:  # the kernels are compiled for the GPU there, not for the interpreter
        pytest.skip("the interpreter tests run on a CPU-only jax")
    from tests import triton_interpreter

    triton_interpreter.install(monkeypatch)
