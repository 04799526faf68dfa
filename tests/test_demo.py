"""`python -m nsa.demo` passes, and finishes without matplotlib (a plain `pip install nsa`), saying how
to get the picture."""

import sys

import numpy as np

from nsa import demo


def test_demo_passes_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert demo.main(["--output", str(tmp_path / "selection.png")]) == 0
    out = capsys.readouterr().out
    assert "no picture of the selected blocks: it needs matplotlib (pip install 'nsa[demo]')" in out
    assert out.rstrip().endswith("PASS") and "FAIL" not in out
    assert not (tmp_path / "selection.png").exists()


def test_demo_picture(tmp_path):
    """The picture (matplotlib: the demo extra, which `make test` installs)."""
    T, S = demo.T, demo.BLOCK_COUNTS
    idx = np.broadcast_to((np.arange(T) // demo.BLOCK_SIZE)[None, :, None, None], (1, T, demo.H, S)).copy()
    idx[..., 1:] = -1
    demo.draw(idx, np.full((demo.H, T), 0.5), str(tmp_path / "selection.png"))
    assert (tmp_path / "selection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
