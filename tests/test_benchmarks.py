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
import pytest

import nsa
import nsa._kvcache

from benchmarks import tpu, tpu_roofline
from benchmarks.common import STANDARD, case_shape, jax_inputs, useful_flops

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.interpreted  # the Pallas kernels in interpret mode: minutes
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
    fwd, _ = tpu.dense_fns(tpu.splash_mask("dense", T, shape), shape, interpret=True)
    out = fwd(*tpu.splash_layout(q, k, v, do, shape)[:3])  # [B, H, G, T, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    f32 = lambda x: x.astype(jnp.float32)
    expected = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(expected), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["window", "compressed_paper"])
def test_branch_baselines_do_the_branch_s_work(case):
    """The splash rows beside the window and compressed attention compute what nsa's op computes (at the smoke
    shape, against implementation="xla"): the same work, so the speedup column compares like with like."""
    shape, T = tpu.SMOKE, 128
    q, k, v, _, do = jax_inputs(T, shape=shape)
    own = case_shape(case, shape)
    fwd, _ = tpu.dense_fns(tpu.splash_mask(case, T, own), shape, interpret=True)
    if case == "window":
        keys = (k, v)
        expected = nsa.sliding_window_attention(q, k, v, window_size=shape.window, implementation="xla")
    else:
        keys = tpu.compressed_rows(q, k, v, own)
        expected = tpu.compressed_fns("xla", own)[0](q, *keys)
    out = fwd(*tpu.splash_layout(q, *keys, do, shape, rows=tpu.splash_mask(case, T, own).shape[1])[:3])
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(jnp.float32)
    expected = expected.astype(jnp.float32)
    seen = np.asarray(jnp.abs(expected).sum(-1) > 0)  # compressed: queries before the first window see nothing
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(expected)[seen], atol=2e-2, rtol=2e-2)


def test_roofline_times_follow_the_model(tmp_path):
    """Every kernel is in the table at both T and chips, each time is the largest of FLOPs / peak,
    bytes / bandwidth, DMAs * issue cost and grid steps * step cost, the binding one named, and each
    total is the sum of nsa.attention's kernels."""
    out = tmp_path / "roofline.json"
    tpu_roofline.main(["--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    names = {r["name"].split(" (")[0] for r in rows}
    assert names == {f"{b} {p}" for b in ("window", "compressed") for p in ("fwd", "dq", "dkdv")} | {
        "select"} | {f"selected {p}" for p in ("fwd", "dq", "dkdv", "reduce")}
    assert {(r["T"], r["chip"]) for r in rows} == {(T, c) for T in (8192, 65536) for c in ("v5p", "v6e")}
    for r in rows:
        chip = tpu_roofline.CHIPS[r["chip"]]
        terms = dict(mxu=r["flops"] / chip.bf16_flops, hbm=r["hbm_bytes"] / chip.hbm_bandwidth,
                     dma=r["dmas"] * tpu_roofline.DMA_ISSUE_S, steps=r["grid_steps"] * tpu_roofline.GRID_STEP_S)
        assert all(t > 0 for k, t in terms.items() if k != "mxu"), r
        assert (terms["mxu"] > 0) == (not r["name"].startswith("selected reduce")), r  # the reduce: VPU adds only
        assert math.isclose(r["ms"], 1e3 * max(terms.values()), rel_tol=1e-12), r
        assert r["binds"] == max(terms, key=terms.get)
    ms = {(r["T"], r["chip"], r["name"]): r["ms"] for r in rows}
    assert len(result["totals"]) == 2 * 2 * 2
    for t in result["totals"]:
        U = t["union"]
        fwd = ["window fwd", "compressed fwd", "select (lse given, 1 pass)", f"selected fwd ({U})"]
        bwd = ["window dq", "window dkdv", "compressed dq", "compressed dkdv"] + [
            f"selected {p} ({U})" for p in ("dq", "dkdv", "reduce")]
        assert math.isclose(t["fwd_ms"], sum(ms[t["T"], t["chip"], n] for n in fwd), rel_tol=1e-12)
        assert math.isclose(t["fwd_bwd_ms"], sum(ms[t["T"], t["chip"], n] for n in fwd + bwd), rel_tol=1e-12)


def test_roofline_counts():
    """The counts against closed forms: the window forward executes, per head and query tile, the key tiles
    its queries see; selected at U = S executes the useful selection FLOPs but for the first S - 1 blocks'
    tokens (fewer candidates) times BK / block_size (a block's matmuls take its BK = 128-row buffer), at
    the all-distinct end every visible block per tile; select walks, per tile, the chunks up to its
    current block's; the grid walk DMAs a block once per change of its index."""
    T, s = 8192, STANDARD
    fwd = tpu_roofline.window_kernels(T)[0]
    tiles = sum(min(i, T // 128 - 1) - max(0, (128 * i - s.window + 1) // 128) + 1 for i in range(T // 128))
    assert fwd.flops == s.HQ * tiles * 4 * 128 * 128 * s.D
    assert tpu_roofline.dma_count(np.array([3, 3, 4, 4, 3])) == 3

    # selected, TB tokens x G heads = R rows per tile, blocks of bs rows multiplied as BK = 128
    G, bs, S, BK, NB = s.HQ // s.H, s.block_size, s.blocks, 128, T // s.block_size
    TB, L = tpu_roofline.selected_config(T)
    R, NT = G * TB, T // TB
    same = tpu_roofline.selected_kernels(T, "same")
    assert same[0].flops == BK / bs * (useful_flops("selection", T) - 2 * s.HQ * bs ** 2 * s.D * S * (S - 1))
    distinct = tpu_roofline.selected_kernels(T, "distinct")
    assert TB * S >= NB  # at T = 8192 a tile's tokens may list every block they see
    assert distinct[0].flops == 2 * s.HQ * BK * s.D * bs * NB * (NB + 1)
    for kernels in (same, distinct):
        pairs = kernels[0].flops / (4 * R * BK * s.D)
        assert kernels[1].flops == 1.5 * kernels[0].flops and kernels[2].flops == 2 * kernels[0].flops
        assert kernels[0].grid_steps == kernels[1].grid_steps == s.H * NT
        assert kernels[0].dmas == 5 * s.H * NT + 2 * pairs  # SMEM row, q, names, o, lse; K and V per block
        assert kernels[1].dmas == 7 * s.H * NT + 2 * pairs
        assert kernels[2].grid_steps == s.H * NB + -(-s.H * NT * min(TB * S, NB) // L)
        assert kernels[3].grid_steps == s.H * NB and kernels[3].flops == 0

    # select at T = 65536 (8 chunks of BC rows), lse given: tile i walks chunks 0 .. hi_i
    T = 65536
    TB, BC = tpu_roofline.select_config(T)
    NT = T // TB
    hi = [((i + 1) * TB - 1) // bs // BC for i in range(NT)]
    one, two = tpu_roofline.select_kernel(T, lse=True), tpu_roofline.select_kernel(T, lse=False)
    assert one.grid_steps == s.H * NT * (T // bs // BC) and two.grid_steps == 2 * one.grid_steps
    assert one.flops == s.H * sum(h + 1 for h in hi) * 2 * G * TB * BC * s.D and two.flops == 2 * one.flops
    k_dmas = sum(h + 1 for h in hi) - sum(1 for i in range(1, NT) if hi[i - 1] == 0)  # chunk 0 kept across tiles
    assert one.dmas == s.H * (4 * NT + k_dmas)  # token rows, q, lse, ids per tile; the chunks


def test_decode_benchmark_runs_on_a_cpu(tmp_path):
    """benchmarks/decode.py at a tiny cache on the CPU (nsa's reference and XLA's dense decode, a ragged batch):
    every row timed, and the bytes it reports follow its model (dense reads every token; NSA the visible
    compressed rows, S blocks and the window, capped by the length)."""
    from benchmarks import decode

    arrays = decode.cache_arrays(2, 1024, ragged=True)
    _, _, k, v, k_cmp, v_cmp, lens = arrays
    paged = decode.paged_cache(k, v, k_cmp, v_cmp, lens, 256)  # the paged rows' cache holds the same rows
    for got, want in zip(nsa._kvcache.sequences(paged), (k, v, k_cmp, v_cmp)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    rows = decode.main(["--out", str(tmp_path), "--batches", "2", "--contexts", "1024", "--long", "--impls", "xla",
                        "--dense", "xla", "--no-fla", "--ragged", "--paged", "256", "--iters", "1"])
    assert [r["impl"] for r in rows] == ["nsa-xla", "nsa-xla-paged", "dense-xla"]
    for row in rows:
        assert "error" not in row, row
        assert math.isfinite(row["step_us"]) and row["step_us"] > 0
    lens = np.random.default_rng(0).integers(512, 1025, 2)
    per_token = 2 * STANDARD.D * 2 * STANDARD.H
    assert rows[2]["bytes_read"] == per_token * lens.sum()
    nsa_tokens = lens // 64 + np.minimum(16 * 64, lens) + np.minimum(512, lens)
    assert rows[0]["bytes_read"] == rows[1]["bytes_read"] == per_token * nsa_tokens.sum()
    assert json.loads((tmp_path / "decode.json").read_text())["rows"] == rows


def test_union_sizes_count_the_distinct_valid_blocks_of_each_tile():
    """union_sizes against a loop over tiles: -1, future blocks and repeats do not count."""
    from benchmarks.common import union_sizes

    rng = np.random.default_rng(0)
    B, T, H, S, bs = 2, 48, 3, 5, 8
    idx = rng.integers(-1, T // bs + 2, (B, T, H, S))
    for tokens in (1, 4, 16):
        counts = [len({int(i) for t in range(t0, t0 + tokens) for i in idx[b, t, h] if 0 <= i <= t // bs})
                  for b in range(B) for t0 in range(0, T, tokens) for h in range(H)]
        assert union_sizes(idx, bs, tokens) == (np.mean(counts), max(counts))


def test_smooth_inputs_change_slowly_along_t():
    """q and k of smooth_inputs have unit scale and neighbours far more alike than tokens 1024 apart."""
    from benchmarks.common import smooth_inputs

    q, k = (np.asarray(x, np.float32) for x in smooth_inputs(2048, hq=4)[:2])
    for x in (q, k):
        assert abs(x.std() - 1) < 0.05
        near = np.mean(np.sum(x[:, 1:] * x[:, :-1], -1)) / np.mean(np.sum(x * x, -1))
        far = np.mean(np.sum(x[:, 1024:] * x[:, :-1024], -1)) / np.mean(np.sum(x * x, -1))
        assert near > 0.9 and abs(far) < 0.1, (near, far)


def test_gpu_runs_merge_into_one_table(tmp_path):
    """benchmarks/gpu.py --merge: the rows of two calls of one lease in one gpu.json, gpu.md and gpu.png, in the
    first file's case order then T; a file of another run (another jax) raises, naming what differs."""
    from benchmarks import gpu

    meta = dict(date="2026-12-04", device="NVIDIA H200", jax="0.11.2", python="3.12.3", shape=STANDARD.describe(),
                triton="3.6.0", torch=None, fla=None, jax_triton="0.3.1", mdy666=None)
    row = lambda case, T, impl, ms: dict(case=case, T=T, impl=impl, useful_tflop_fwd=1.0, fwd_ms=ms, fwd_bwd_ms=3 * ms)
    files = {"a.json": [row("window", 65536, "nsa-triton", 4.0), row("full", 65536, "nsa-triton", 30.0)],
             "b.json": [row("window", 8192, "nsa-triton", 0.6), row("window", 8192, "dense-cudnn (window)", 0.5),
                        row("full", 8192, "nsa-triton", 3.0)]}
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(dict(meta=meta, rows=rows)))
    paths = [str(tmp_path / name) for name in files]
    text = gpu.merge(paths, str(tmp_path))
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert [(r["case"], r["T"]) for r in merged["rows"]] == [
        ("window", 8192), ("window", 8192), ("window", 65536), ("full", 8192), ("full", 65536)]
    assert merged["meta"]["merged"] == ["a.json", "b.json"] and merged["meta"]["date"] == ["2026-12-04"]
    assert (tmp_path / "gpu.md").read_text().strip() == text and (tmp_path / "gpu.png").stat().st_size > 0
    assert "| window | 8192 | nsa-triton | 0.60 | 1.80 |" in text and "0.83x" in text  # cuDNN's window: 1.5 / 1.8

    (tmp_path / "b.json").write_text(json.dumps(dict(meta=dict(meta, jax="0.10.2"), rows=files["b.json"])))
    with pytest.raises(ValueError, match=r"b.json is not of the same run as .*a.json: \['jax'\] differ"):
        gpu.merge(paths, str(tmp_path))


def test_context_model_counts():
    """benchmarks/context_model.py: the bytes a device moves are (P - 1) / P of k, v gathered twice and dk, dv
    (float32) scattered once; its compute falls as 1 / P; it writes its rows."""
    from benchmarks import context_model as cm

    T, P = 1 << 20, 8
    r = cm.row(T, P)
    kv = T * cm.H * cm.D * 2 * 2
    assert r["bytes_moved_GB"] == pytest.approx((P - 1) / P * 4 * kv / 1e9)
    assert r["tflops"] == pytest.approx(2 * cm.row(T, 2 * P)["tflops"])
    assert r["NVLink_ms"] == pytest.approx(r["400Gb/s_ms"] * cm.LINKS["400Gb/s"] / cm.LINKS["NVLink"])
    rows = cm.main([])
    assert len(rows) == len(cm.TOKENS) * len(cm.DEVICES)
