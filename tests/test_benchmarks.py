"""The TPU benchmark runs on a CPU (--smoke), its dense baseline computes causal GQA attention, and the
roofline's times follow its model.

test_tpu_smoke needs implementation="pallas" dispatched (interpret mode off-TPU): until then it fails with
the dispatch's ValueError, as it should.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import tpu, tpu_roofline
from benchmarks.common import STANDARD, jax_inputs, useful_flops

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_smoke(tmp_path):
    """python benchmarks/tpu.py --smoke, as CI runs it: every row of every case, finite positive times."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu.py"), "--out", str(tmp_path), "--smoke"],
                   check=True, cwd=ROOT, timeout=600)
    result = json.loads((tmp_path / "tpu.json").read_text())
    rows = {(r["case"], r["impl"]): r for r in result["rows"]}
    expected = {(c, f"nsa-{i}") for c in ("selection", "full") for i in ("pallas", "xla")} | {("dense", "dense-splash")}
    assert set(rows) == expected
    for row in rows.values():
        assert "error" not in row, row
        assert row["T"] == tpu.SMOKE_SEQ_LEN
        for field in ("fwd_ms", "fwd_bwd_ms"):
            assert math.isfinite(row[field]) and row[field] > 0, row
    meta = result["meta"]
    assert meta["shape"] == tpu.SMOKE._asdict() | {"dtype": "bfloat16"} and meta["smoke"]
    assert {"date", "device", "tpu_generation", "jax", "jaxlib", "libtpu"} <= set(meta)
    assert "dense-splash" in (tmp_path / "tpu.md").read_text()


def test_dense_baseline_is_causal_gqa_attention():
    """The splash rows time causal attention with HQ / H query heads per KV head (checked at the smoke shape
    against jax.nn.dot_product_attention)."""
    shape, T = tpu.SMOKE, 128
    q, k, v, _, do = jax_inputs(T, shape=shape)
    fwd, _ = tpu.dense_fns(T, shape, interpret=True)
    out = fwd(*tpu.splash_layout(q, k, v, do, shape)[:3])  # [B, H, G, T, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    f32 = lambda x: x.astype(jnp.float32)
    expected = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(expected), atol=2e-2, rtol=2e-2)


def test_roofline_times_follow_the_model(tmp_path):
    """Every kernel is in the table at both T and chips, and each time is the largest of FLOPs / peak,
    bytes / bandwidth, DMAs * issue cost and grid steps * step cost, the binding one named."""
    out = tmp_path / "roofline.json"
    tpu_roofline.main(["--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    names = {r["name"].split(" (")[0] for r in rows}
    assert names == {f"{b} {p}" for b in ("window", "compressed") for p in ("fwd", "dq", "dkdv")} | {
        "select"} | {f"selected {p}" for p in ("fwd", "dq", "dkdv")}
    assert {(r["T"], r["chip"]) for r in rows} == {(T, c) for T in (8192, 65536) for c in ("v5p", "v6e")}
    for r in rows:
        chip = tpu_roofline.CHIPS[r["chip"]]
        terms = dict(mxu=r["flops"] / chip.bf16_flops, hbm=r["hbm_bytes"] / chip.hbm_bandwidth,
                     dma=r["dmas"] * tpu_roofline.DMA_ISSUE_S, steps=r["grid_steps"] * tpu_roofline.GRID_STEP_S)
        assert all(t > 0 for t in terms.values()), r
        assert math.isclose(r["ms"], 1e3 * max(terms.values()), rel_tol=1e-12), r
        assert r["binds"] == max(terms, key=terms.get)


def test_roofline_counts():
    """The counts against closed forms: the window forward executes, per head and query tile, the key tiles
    its queries see; selected at U = S executes exactly the useful selection FLOPs; the grid walk DMAs
    a block once per change of its index."""
    T, s = 8192, STANDARD
    fwd = tpu_roofline.window_kernels(T)[0]
    tiles = sum(min(i, T // 128 - 1) - max(0, (128 * i - s.window + 1) // 128) + 1 for i in range(T // 128))
    assert fwd.flops == s.HQ * tiles * 4 * 128 * 128 * s.D
    selected = tpu_roofline.selected_kernels(T, s.blocks)[0]
    assert selected.flops == useful_flops("selection", T)
    assert tpu_roofline.dma_count(np.array([3, 3, 4, 4, 3])) == 3
