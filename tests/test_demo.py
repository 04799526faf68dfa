"""`python -m nsa.demo` passes, says that its inputs are random, and finishes without matplotlib (a plain
`pip install .`), saying how to get the picture."""

import sys

import numpy as np

from nsa import demo


def test_demo_passes_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert demo.main(["--output", str(tmp_path / "selection.png")]) == 0
    out = capsys.readouterr().out
    assert "no picture of the selected blocks: it needs matplotlib (from a checkout: pip install '.[demo]')" in out
    assert out.rstrip().endswith("PASS") and "FAIL" not in out
    assert f"inputs: random q, k, v and gates (seed 0); {demo.RANDOM_INPUTS_NOTE}" in out
    assert not (tmp_path / "selection.png").exists()


def test_demo_picture(tmp_path):
    """The picture (matplotlib: the demo extra, which `make test` installs), titled as drawn from random inputs."""
    T, S = demo.T, demo.BLOCK_COUNTS
    idx = np.broadcast_to((np.arange(T) // demo.BLOCK_SIZE)[None, :, None, None], (1, T, demo.H, S)).copy()
    idx[..., 1:] = -1
    share = np.full((demo.H, T), 0.5)
    demo.draw(idx, share, str(tmp_path / "selection.png"))
    assert (tmp_path / "selection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = demo.figure(idx, share)
    assert fig.get_suptitle().startswith("Native Sparse Attention on random inputs")
    assert "on random q, k (no trained model)" in fig.axes[0].get_title()
