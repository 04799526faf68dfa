"""benchmarks/learning.py at its --smoke size: a few steps train (the loss falls), and learning.json and
learning.md hold what the docs cite."""

import json

from benchmarks import learning

STEPS = 20


def test_learning_smoke(tmp_path):
    variants = ["dense", "nsa"]
    learning.main(["--smoke", "--max-steps", str(STEPS), "--variants", *variants, "--seeds", "0",
                   "--out", str(tmp_path)])
    result = json.loads((tmp_path / "learning.json").read_text())
    meta = result["meta"]
    assert {"date", "jax", "jaxlib", "python", "machine", "commands", "setup", "thresholds"} <= set(meta)
    assert meta["setup"]["model"] == learning.SMOKE["model"]
    assert [r["variant"] for r in result["runs"]] == variants
    for run in result["runs"]:
        assert {"seed", "config", "steps", "loss", "accuracy", "steps_to", "cpu_s", "wall_s"} <= set(run)
        assert run["steps"] == len(run["loss"]) == len(run["accuracy"])
        reached = run["steps_to"]["0.9"]
        assert run["steps"] == (STEPS if reached is None else min(STEPS, reached + learning.PATIENCE + 1))
        assert set(run["steps_to"]) == {str(t) for t in learning.THRESHOLDS}
        first, last = run["loss"][:5], run["loss"][-5:]
        assert sum(last) < sum(first), run["loss"]  # it trains
    table = (tmp_path / "learning.md").read_text()
    assert all(f"| {variant} | 1 |" in table for variant in variants)


def test_steps_to_counts_the_steps_trained():
    """Accuracy i is measured after i updates: the first one at or above a threshold is the step count."""
    assert learning.steps_to([0.0, 0.2, 0.5, 0.7, 0.95, 0.8]) == {"0.05": 1, "0.5": 2, "0.9": 4}
    assert learning.steps_to([0.0, 0.0, 0.6]) == {"0.05": 2, "0.5": 2, "0.9": None}
