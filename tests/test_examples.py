"""The examples run and pass their own checks: examples/generate.py generates with a KV cache (through the
layer nsa.nnx.NativeSparseAttention, so it needs flax) and matches a full recompute at every step;
examples/serving.py serves requests by continuous batching over a paged cache (ragged steps of chunked prefill and
decode, pages handed out and reused) and matches a full recompute at every generated token;
examples/learned_compression.py trains the paper's learned phi inside NSA, its loss falls below the uniform
guess, and phi's gradients agree with finite differences; examples/context_parallel.py trains a model with its
sequence split over 4 CPU devices (nsa.attention(..., context_axis=)) and its loss equals the one-device run's at
every step; examples/train_nnx.py trains a model around nsa.nnx.NativeSparseAttention with optax (nnx.Optimizer),
here for a few steps: its loss on a held-out batch falls."""

import importlib.util
import pathlib
import subprocess
import sys

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


def test_serving_matches_a_full_recompute_at_every_token(capsys):
    assert _load("serving").main([]) == 0
    out = capsys.readouterr().out
    assert out.count("same tokens: True") == 7 and out.rstrip().endswith("PASS")
    handed_out = int(out.split("handed out ")[1].split()[0])
    assert handed_out > 9  # more pages handed out than the pool holds: freed pages were reused


def test_learned_compression_learns_and_its_gradients_agree():
    # its own process: the example turns on float64 (jax_enable_x64) for its finite differences
    done = subprocess.run([sys.executable, str(EXAMPLES / "learned_compression.py"), "--steps", "200"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": learned" in done.stdout and "gradients agree" in done.stdout and done.stdout.rstrip().endswith("PASS")


def test_context_parallel_training_equals_one_device():
    # its own process: the example makes its 4 CPU devices before jax starts
    done = subprocess.run([sys.executable, str(EXAMPLES / "context_parallel.py"), "--steps", "20"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "losses agree at every step: True" in done.stdout and done.stdout.rstrip().endswith("PASS")


def test_training_the_nnx_layer_with_optax_lowers_the_loss(capsys):
    assert _load("train_nnx").main(["--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "held-out loss falls: True" in out and out.rstrip().endswith("PASS")
