"""Test-wide setup: on a CPU-only jax, Triton kernels run in Triton's interpreter; on a GPU, float32
matmuls run in full precision so the XLA reference stays a reference.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports nsa.triton. The `interpreted` fixture routes implementation="triton" to the interpreted
kernels for one test (nsa/triton/interpreter.py); `without_jax_triton` hides jax_triton; `pallas_races` turns Pallas interpret mode's race
detector on for one test and fails it on a race. `pytest_generate_tests` makes the cases of the shared
test base for each of its subclasses (tests/base.py).
"""

import os
import sys

import jax
import pytest

# the context-parallel tests (tests/test_context.py) split one sequence over meshes of up to 8 CPU devices; set
# before jax starts its backends (jax.default_backend below)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
ON_GPU = jax.default_backend() == "gpu"
if ON_GPU:  # float32 matmuls of the XLA reference would otherwise run in TF32 (about 4e-4 error)
    jax.config.update("jax_default_matmul_precision", "highest")
else:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def interpreted():
    if ON_GPU:  # the kernels are compiled for the GPU there, not for the interpreter
        pytest.skip("the interpreter tests run on a CPU-only jax")
    from nsa.triton import interpreter

    with interpreter.interpreted():
        yield


@pytest.fixture
def without_jax_triton(monkeypatch):
    """A process where jax_triton does not import (a plain `pip install .` on a GPU, or jax[cuda] alone), with
    nsa's warn-once memory cleared."""
    from nsa import _dispatch
    from nsa.triton._launch import jax_triton_error

    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import jax_triton raises ImportError
    monkeypatch.setattr(_dispatch, "_warned", set())
    jax_triton_error.cache_clear()
    yield
    jax_triton_error.cache_clear()


def pytest_generate_tests(metafunc):
    """The cases of a test base test marked @cases(kind), made for its subclass (tests/base.py)."""
    marker = metafunc.definition.get_closest_marker("cases")
    if marker is not None:
        metafunc.parametrize(*metafunc.cls.case_params(*marker.args, **marker.kwargs))


# The markers of the slowest tests, in the order they run first: pytest-xdist's worksteal hands each worker a
# contiguous share of the collection order and steals from the ends of those shares, so a test of minutes
# collected late (the notebooks are) keeps one core busy at the end while the other idles.
SLOW_FIRST = ("notebook", "interpreted")


def pytest_collection_modifyitems(config, items):
    """Runs the tests marked SLOW_FIRST before the others (a stable sort: otherwise in collection order)."""
    rank = lambda item: next((i for i, m in enumerate(SLOW_FIRST) if item.get_closest_marker(m)), len(SLOW_FIRST))
    items.sort(key=rank)


@pytest.fixture
def pallas_races(monkeypatch):
    """implementation="pallas" (TPU interpret mode off TPU) with interpret mode's race detector on, for one
    test; the test fails if any kernel it ran raced."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the detector's state lives here

    from nsa import pallas

    detectors = []

    class Recorded(interpret_pallas_call.RaceDetectionState):  # one per interpreted kernel call
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            detectors.append(self)

    monkeypatch.setattr(interpret_pallas_call, "RaceDetectionState", Recorded)
    monkeypatch.setitem(pallas.INTERPRET, "detect_races", True)
    yield
    assert not any(d.races_found for d in detectors), "a Pallas kernel raced (interpret mode's race detector)"
