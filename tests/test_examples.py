"""The examples run and pass their own checks: examples/generate.py generates with a KV cache (through the
layer nsa.nnx.NativeSparseAttention, so it needs flax) and matches a full recompute at every step."""

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_matches_a_full_recompute_at_every_step(capsys):
    assert _load("generate").main(["--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "same tokens: True" in out and out.rstrip().endswith("PASS")
