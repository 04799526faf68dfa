"""What the GPU and the TPU benchmark share: the shape, the cases, the inputs, the FLOP count, the timing
loop, the rows, the table and the JSON.

A benchmark (benchmarks/gpu.py, benchmarks/tpu.py) supplies, per (case, T), the rows it times (a
generator of `measure(...)` results); `run` walks the cases and sequence lengths, prints each row as JSON
as soon as it is timed, and returns them; `table` renders them as markdown, with a speedup column
against a baseline row the benchmark names; `write_json` writes {meta, rows}.
"""

import json
import os
import platform
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import nsa


class Shape(NamedTuple):
    """The attention shape and NSA configuration a benchmark runs at (bf16)."""

    B: int = 1
    HQ: int = 64
    H: int = 4
    D: int = 128
    block_size: int = 64
    blocks: int = 16  # selected blocks per (token, KV head)
    window: int = 512
    compress_block_size: int = 0  # l, the compression window (0: block_size)
    compress_stride: int = 0  # d, its stride (0: block_size)

    def describe(self):
        """The shape as the JSON's meta records it."""
        return dict(B=self.B, HQ=self.HQ, H=self.H, D=self.D, block_size=self.block_size, blocks=self.blocks,
                    window=self.window, compress_block_size=self.compress_block_size,
                    compress_stride=self.compress_stride, dtype="bfloat16")

    @property
    def stride(self):
        return self.compress_stride or self.block_size

    def compression(self):
        """nsa.attention's compression arguments (None: the selection block)."""
        return dict(compress_block_size=self.compress_block_size or None, compress_stride=self.compress_stride or None)


STANDARD = Shape()
# The cases of nsa.attention as a whole: their compression (l, d) (0: the selection block) and whether the sliding
# window is on; "selection" is the selected branch alone. paper* is the paper's compression (arXiv 2502.11089,
# Section 3.3): windows of l = 32 every d = 16 beside selection blocks of 64. The _nowin cases are what
# mdy666's NSA runs without flash-attn.
FULL_CASES = {"full": ((0, 0), True), "full_nowin": ((0, 0), False),
              "paper": ((32, 16), True), "paper_nowin": ((32, 16), False)}


# Compressed attention alone (nsa.compressed_attention on compress's rows), at the selection block's compression
# and at the paper's.
BRANCH_CASES = {"compressed": (0, 0), "compressed_paper": (32, 16)}


# The cases whose inputs have locality along T (smooth_inputs; the selection on select_blocks' choice on them), each
# with the case it is the local twin of: what a trained model's neighbouring queries come closer to.
LOCAL_CASES = {"selection_local": "selection", "full_local": "full", "full_nowin_local": "full_nowin",
               "paper_local": "paper", "paper_nowin_local": "paper_nowin"}


def case_shape(case, shape=STANDARD):
    """The Shape a case runs at: `shape` for selection and window, else with the case's compression and window."""
    case = LOCAL_CASES.get(case, case)
    if case in ("selection", "window"):
        return shape
    if case in BRANCH_CASES:
        l, d = BRANCH_CASES[case]
        return shape._replace(compress_block_size=l, compress_stride=d)
    (l, d), window = FULL_CASES[case]
    shape = shape._replace(compress_block_size=l, compress_stride=d)
    return shape if window else shape._replace(window=0)

# fwd+bwd FLOPs per forward FLOP: two matmuls forward, five backward (recomputed scores, dp, dv, dq, dk)
FWD_BWD_FLOPS_FACTOR = 3.5


def useful_flops(case, T, shape=STANDARD):
    """Forward FLOPs of the useful work (what a perfect kernel must compute); forward+backward counts
    FWD_BWD_FLOPS_FACTOR times as much. Cases: 'selection' (selected attention alone), 'full' (compression
    + top-k scores + selection + window), 'window' (the sliding window alone), 'dense' (causal attention); a
    local case as its twin."""
    if case == "dense":
        return dense_flops(T, shape)
    if case == "window":
        return window_flops(T, shape)
    shape = case_shape(case, shape)
    if case in BRANCH_CASES:
        return compressed_flops(T, shape)
    case = LOCAL_CASES.get(case, case)
    HQ, D = shape.HQ, shape.D
    selection = 4 * T * HQ * shape.blocks * shape.block_size * D
    if case == "selection":
        return selection
    window = window_flops(T, shape)
    compressed = compressed_flops(T, shape)
    scores = compressed / 2
    return selection + window + compressed + scores


def compressed_flops(T, shape=STANDARD):
    """Compressed attention's share of useful_flops('full'): each query against the T / d rows, half of them seen."""
    return 4 * T * shape.HQ * (T // shape.stride) / 2 * shape.D


def window_flops(T, shape=STANDARD):
    """The sliding window's share of useful_flops('full')."""
    return 4 * T * shape.HQ * shape.window * shape.D


def dense_flops(T, shape=STANDARD):
    """Causal dense attention: half of the 4 T^2 HQ D of full attention."""
    return 2 * T * T * shape.HQ * shape.D


def time_jax(fn, args, iters):
    """Median seconds per call of a jitted fn, after warm-up."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compiled_memory_gib(compiled):
    """(peak, arguments + outputs) of a compiled jitted fn in GiB, from XLA's buffer assignment: Triton and Pallas
    kernels allocate nothing beyond their outputs, so the peak is the program's."""
    stats = compiled.memory_analysis()
    peak = getattr(stats, "peak_memory_in_bytes", 0) or (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)
    return peak / 2 ** 30, (stats.argument_size_in_bytes + stats.output_size_in_bytes) / 2 ** 30


def jax_inputs(T, seed=0, hq=None, shape=STANDARD):
    """q [B, T, hq, D], k, v [B, T, H, D], the three gates [B, T, hq] and the output cotangent, bf16."""
    hq = shape.HQ if hq is None else hq
    B, H, D = shape.B, shape.H, shape.D
    keys = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(keys[0], (B, T, hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.bfloat16)
    gates = [jax.nn.sigmoid(jax.random.normal(key, (B, T, hq))).astype(jnp.bfloat16) for key in keys[3:6]]
    do = jax.random.normal(keys[6], (B, T, hq, D), jnp.bfloat16)
    return q, k, v, gates, do


def smooth(key, shape, T, correlation=256, noise=0.25, dtype=jnp.bfloat16):
    """A [B, T, ...] array that changes slowly along T: standard normal anchors every `correlation` tokens,
    linearly interpolated, plus `noise` times iid normal noise (rescaled to unit variance). Queries and keys
    like this select much the same blocks at neighbouring positions, as a trained model's do."""
    anchors_key, noise_key = jax.random.split(key)
    n = T // correlation + 2
    anchors = jax.random.normal(anchors_key, (shape[0], n) + tuple(shape[2:]), jnp.float32)
    x = jnp.arange(T) / correlation
    i = jnp.floor(x).astype(jnp.int32)
    w = (x - i).reshape((1, T) + (1,) * (len(shape) - 2))
    # linear interpolation between two unit-variance anchors has variance (1 - w)^2 + w^2
    line = (anchors[:, i] * (1 - w) + anchors[:, i + 1] * w) / jnp.sqrt((1 - w) ** 2 + w ** 2)
    mixed = line + noise * jax.random.normal(noise_key, shape, jnp.float32)
    return (mixed / jnp.sqrt(1 + noise ** 2)).astype(dtype)


def smooth_inputs(T, seed=0, hq=None, shape=STANDARD):
    """jax_inputs with q and k from `smooth`: the inputs with locality along T that the locality rows select on."""
    q, k, v, gates, do = jax_inputs(T, seed, hq, shape)
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    return smooth(keys[0], q.shape, T), smooth(keys[1], k.shape, T), v, gates, do


def union_sizes(idx, block_size, tokens):
    """Mean and max over (b, tile, h) of the number of distinct valid blocks that `tokens` consecutive queries
    list in idx [B, T, H, S] (T a multiple of tokens; a slot is valid when 0 <= id <= its query's block): what
    a kernel that packs `tokens` queries into one tile loads, against S per query unpacked."""
    idx = np.asarray(idx)
    B, T, H, S = idx.shape
    current = (np.arange(T) // block_size)[None, :, None, None]
    valid = np.where((idx >= 0) & (idx <= current), idx, -1)
    tiles = valid.reshape(B, T // tokens, tokens, H, S).transpose(0, 1, 3, 2, 4).reshape(B, T // tokens, H, -1)
    tiles = np.sort(tiles, axis=-1)
    distinct = (tiles[..., 1:] != tiles[..., :-1]) & (tiles[..., 1:] >= 0)
    count = distinct.sum(-1) + (tiles[..., 0] >= 0)
    return float(count.mean()), int(count.max())


def random_block_indices(T, seed=0, shape=STANDARD):
    """`shape.blocks` distinct blocks per (token, KV head) among the visible ones (fewer visible: -1 padded)."""
    BS, S, H = shape.block_size, shape.blocks, shape.H
    rng = np.random.default_rng(seed)
    chunks = []
    for first in range(0, T, 2048):  # the same draws as one [T, H, T // BS + 1], a chunk of tokens at a time (64k)
        current = np.arange(first, min(T, first + 2048)) // BS
        scores = rng.random((len(current), H, T // BS + 1))
        scores = np.where(np.arange(T // BS + 1)[None, None, :] > current[:, None, None], -1.0, scores)
        idx = np.argsort(-scores, axis=-1)[..., :S]
        chunks.append(np.where(np.take_along_axis(scores, idx, -1) < 0, -1, idx))
    return np.concatenate(chunks)[None].astype(np.int32)


def selection_of(case, T, q, k, shape=STANDARD):
    """The block indices a case's selection rows attend (random ones for selection, select_blocks' choice on q and
    k for selection_local), or those the full cases' nsa.attention selects inside, for their union sizes; None for
    the window and compressed attention."""
    if case == "selection":
        return random_block_indices(T, shape=shape)
    if case in ("window", "compressed"):
        return None
    shape = case_shape(case, shape)
    k_cmp = nsa.compress(k, block_size=shape.compress_block_size or shape.block_size, stride=shape.stride)
    return jax.jit(lambda q, k_cmp: nsa.select_blocks(q, k_cmp, block_counts=shape.blocks, block_size=shape.block_size,
                                                      **shape.compression()))(q, k_cmp)


def loss_of(forward):
    """sum(forward(*args, do) * do) in float32: its gradient is the backward with cotangent do."""
    def loss(*args):
        *inputs, do = args
        return jnp.sum(forward(*inputs).astype(jnp.float32) * do.astype(jnp.float32))

    return loss


def implementation_of(name):
    """nsa's `implementation` argument for a benchmark's implementation name: "auto" is None (implementation=None,
    what nsa._dispatch picks per op), any other name is itself ("triton", "pallas", "xla")."""
    return None if name == "auto" else name


def nsa_fns(case, implementation, T, idx, shape=STANDARD):
    """(forward, forward+backward) jitted fns of (q, k, v, gates, do) for nsa's `case` with `implementation`
    (selection: on the block indices idx); the backward differentiates q, k, v and the gates (the window's gate
    only where the window is on)."""
    shape = case_shape(case, shape)
    BS, S = shape.block_size, shape.blocks
    case = LOCAL_CASES.get(case, case)

    def forward(q, k, v, g):
        if case == "selection":
            return nsa.selected_attention(q, k, v, idx, block_size=BS, implementation=implementation)
        if case == "window":
            return nsa.sliding_window_attention(q, k, v, window_size=shape.window, implementation=implementation)
        return nsa.attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2] if shape.window else None,
                             block_counts=S, block_size=BS, window_size=shape.window, implementation=implementation,
                             **shape.compression())

    fwd = jax.jit(lambda q, k, v, g, do: forward(q, k, v, g))  # do: the forward+backward's arguments, unused
    fwd_bwd = jax.jit(jax.grad(loss_of(forward), argnums=(0, 1, 2, 3)))
    return fwd, fwd_bwd


def error_text(e):
    """How a row records a failure."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def measure(row, timings, strict=False):
    """`row` after `timings(row)` has added its fields (fwd_ms, fwd_bwd_ms...) to it; when that raises, the
    error is recorded in row['error'] next to the fields already added (the table says what failed), or,
    if `strict`, raised."""
    try:
        timings(row)
    except Exception as e:
        if strict:
            raise
        row["error"] = error_text(e)
    return row


def jax_timings(fwd, fwd_bwd, fwd_args, fwd_bwd_args, iters):
    """A `timings` for `measure`: fwd_ms, fwd_bwd_ms (medians) and the fwd+bwd memory of two jitted fns, each
    compiled once (the executable timed is the one whose memory is read)."""
    def timings(row):
        row["fwd_ms"] = 1e3 * time_jax(fwd.lower(*fwd_args).compile(), fwd_args, iters)
        fwd_bwd_compiled = fwd_bwd.lower(*fwd_bwd_args).compile()
        row["fwd_bwd_ms"] = 1e3 * time_jax(fwd_bwd_compiled, fwd_bwd_args, iters)
        row["fwd_bwd_peak_gib"], row["fwd_bwd_io_gib"] = compiled_memory_gib(fwd_bwd_compiled)

    return timings


def run(cases, seq_lens, rows_for):
    """Every row of every (case, T): rows_for(case, T) yields them; each is printed as JSON when it is done."""
    rows = []
    for case in cases:
        for T in seq_lens:
            for row in rows_for(case, T):
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(rows, baseline_name, is_baseline):
    """Markdown table of the rows; the speedup column is the fwd+bwd time of the first row b without an
    error for which is_baseline(row, b), over the row's."""
    lines = [f"| case | T | implementation | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd speedup vs "
             f"{baseline_name} | fwd+bwd peak GiB (inputs + outputs) | distinct blocks per 4 / 64 tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['T']} | {r['impl']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        union = f"{r['union4_mean']:.1f} / {r['union64_mean']:.1f}" if "union4_mean" in r else "-"
        base = next((b for b in rows if is_baseline(r, b) and "error" not in b), None)
        speedup = f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if base else "-"
        memory = f"{r['fwd_bwd_peak_gib']:.1f} ({r['fwd_bwd_io_gib']:.1f})" if "fwd_bwd_peak_gib" in r else "-"
        lines.append(f"| {r['case']} | {r['T']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                     f"{r['useful_tflop_fwd'] / r['fwd_ms'] * 1e3:.0f} | "
                     f"{FWD_BWD_FLOPS_FACTOR * r['useful_tflop_fwd'] / r['fwd_bwd_ms'] * 1e3:.0f} | {speedup} | {memory} | "
                     f"{union} |")
    return "\n".join(lines)


def meta(shape=STANDARD, **extra):
    """The run's metadata: date, device kind, jax version, Python version, shape, XLA_FLAGS where set, then
    `extra`."""
    flags = {"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {}
    return dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                python=platform.python_version(), shape=shape.describe(), **flags, **extra)


def module_versions(names):
    """{name: the module's __version__, or None where it does not import}."""
    versions = {}
    for name in names:
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            versions[name] = None
    return versions


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
