"""Where nsa.attention's forward+backward memory goes (issue 52: a peak of at most 1.5x splash attention's at 64k), one
row per (case, T): XLA's buffer assignment of the compiled forward+backward of `benchmarks.common.nsa_fns` (peak,
temporaries, arguments, outputs; the peak `benchmarks/tpu.py` reports), the largest arrays of its optimized HLO as the
chip stores them (the minor dims rounded up to the layout's tiles: a float32 [.., G, 1] row statistic takes 128 lanes a
value), splash's causal forward+backward beside it, and the residuals autodiff keeps from the forward for the backward
(`jax.ad_checkpoint.print_saved_residuals`, summed by shape and dtype, largest first; an array saved for several ops,
such as q, counts once for each), and the arrays live at the peak with the jax ops that made them (XLA's live-range
dump of the compile, `live_at_peak`). It compiles and never runs, so a tree's rows take its compiles only (about 40 s
an nsa row on a TPU v5e); run in an earlier tree (scripts/tpu_check.sh part memory) it says what a change did to the
memory.

    python3 scripts/tpu_memory_probe.py [--seq-lens 16384 65536] [--cases full full_nowin] [--out DIR]

Off a TPU it runs at benchmarks/tpu.py's smoke shape and length (T = 128), Pallas in interpret mode, to prove that it
runs.
"""

import argparse
import collections
import contextlib
import glob
import io
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks import tpu  # noqa: E402
from benchmarks.common import STANDARD, compiled_memory_gib, nsa_fns  # noqa: E402

GIB = 2 ** 30


def residuals(fn, args):
    """[(shape and dtype, count, GiB)] of what autodiff saves of fn(*args) for its backward, largest first."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    sizes = collections.Counter()
    counts = collections.Counter()
    for dtype, dims in re.findall(r"^(\w+)\[([\d,]*)\]", text.getvalue(), flags=re.M):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        key = f"{dtype}[{dims}]"
        bits = re.search(r"\d+$", dtype)  # jaxpr's names: bf16, f32, i32 (bool: a byte)
        sizes[key] += n * (int(bits.group()) // 8 if bits else 1) / GIB
        counts[key] += 1
    return [(key, counts[key], round(gib, 4)) for key, gib in sizes.most_common()]


BYTES = dict(pred=1, s8=1, u8=1, bf16=2, f16=2, s16=2, u16=2, f32=4, s32=4, u32=4, f64=8, s64=8, u64=8)
ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
ALIASES = ("bitcast", "get-tuple-element", "tuple")  # views of another instruction's buffer


def tiled_bytes(dtype, dims, layout):
    """(logical, stored) bytes of one array of an optimized HLO: stored rounds the minor dims up to the layout's first
    tile, as the TPU keeps them (f32[.., 16, 1]{..:T(8,128)} holds 128 lanes for each row's one value)."""
    dims = [int(d) for d in filter(None, dims.split(","))]
    logical = BYTES.get(dtype, 4)
    for d in dims:
        logical *= d
    tile = re.search(r":.*?T\(([\d,]+)\)", layout or "")
    if not tile or not dims:
        return logical, logical
    minor_to_major = [int(d) for d in layout.split(":")[0].split(",") if d]
    stored = list(dims)
    for dim, size in zip(minor_to_major, reversed([int(t) for t in tile.group(1).split(",")])):
        stored[dim] = -(-stored[dim] // size) * size
    stored_bytes = BYTES.get(dtype, 4)
    for d in stored:
        stored_bytes *= d
    return logical, stored_bytes


def largest_buffers(hlo_text, top=10):
    """The `top` largest arrays that the optimized HLO's non-fused computations define (entry, loops), by their
    stored size under the layout's tiles: [dict(name, op, type, gib, stored_gib)]; views (bitcasts, tuples, a loop
    body's parameters) skipped. A list of suspects, not the peak's live set (XLA's buffer assignment, the peak)."""
    rows, fused, entry = [], False, False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header
            fused = line.split()[0].lstrip("%").startswith("fused")
            entry = line.startswith("ENTRY")
            continue
        match = INSTRUCTION.match(line)
        if fused or not match or match.group(3) in ALIASES or (match.group(3) == "parameter" and not entry):
            continue
        name, kind, op = match.groups()
        sizes = [tiled_bytes(*array) for array in ARRAY.findall(kind)]
        stored = sum(s for _, s in sizes)
        rows.append(dict(name=name, op=op, type=kind[:160], gib=round(sum(l for l, _ in sizes) / GIB, 4),
                         stored_gib=round(stored / GIB, 4)))
    return sorted(rows, key=lambda row: -row["stored_gib"])[:top]


LIVE = re.compile(r"^\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")


def live_at_peak(dump_dir, hlo_text, top=16):
    """The arrays live at the buffer assignment's peak, from XLA's live-range dump in `dump_dir` (its "Live ranges at
    N (peak)" section), largest first, each with its instruction's type from the optimized HLO: [dict(name, gib,
    type)], and the dump's stack-trace breakdown of the peak (which jax ops made its bytes) as lines."""
    paths = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt")), key=os.path.getsize)
    if not paths:
        raise FileNotFoundError(f"no XLA live-range dump in {dump_dir}: {sorted(os.listdir(dump_dir))[:8]}")
    with open(paths[-1]) as f:
        lines = f.read().split("\n")
    start = next((i for i, line in enumerate(lines) if "(peak):" in line), None)
    if start is None:
        raise ValueError(f"XLA's live-range dump {paths[-1]} has no 'Live ranges at N (peak):' section")
    types = {m.group(1): m.group(2) for m in map(INSTRUCTION.match, hlo_text.splitlines()) if m}
    live = []
    for line in lines[start + 1:]:
        match = LIVE.match(line)
        if not match:
            break
        kind, index = types.get(match.group(1), "?"), match.group(2)
        arrays = ARRAY.findall(kind)
        if index.isdigit() and len(arrays) > int(index):  # one element of a tuple-shaped instruction
            kind = "{}[{}]{{{}}}".format(*arrays[int(index)])
        live.append(dict(name=f"{match.group(1)}{{{index}}}", gib=round(int(match.group(3)) / GIB, 4), type=kind[:160]))
    trace = [line.rstrip() for line in lines[start + 1 + len(live):] if line.strip()]
    return sorted(live, key=lambda row: -row["gib"])[:top], trace[:40]


def memory_row(name, T, lowered):
    """The buffer assignment's sizes of a lowered fn compiled, GiB, its largest arrays as the chip stores them, and
    the arrays live at its peak (XLA's live-range dump, `live_at_peak`)."""
    with tempfile.TemporaryDirectory() as dump_dir:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump_dir})
        hlo_text = compiled.as_text()
        peak_live, peak_trace = live_at_peak(dump_dir, hlo_text)
    stats = compiled.memory_analysis()
    peak, io_gib = compiled_memory_gib(compiled)
    return dict(case=name, T=T, peak_gib=peak, arguments_outputs_gib=io_gib,
                temp_gib=stats.temp_size_in_bytes / GIB, alias_gib=stats.alias_size_in_bytes / GIB,
                largest_buffers=largest_buffers(hlo_text), peak_live=peak_live, peak_trace=peak_trace)


def nsa_row(case, T, shape, implementation):
    """The memory row of nsa's `case` at T, with its residuals."""
    B, H, D, HQ = shape.B, shape.H, shape.D, shape.HQ
    struct = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.bfloat16)
    q, k, gates = struct(B, T, HQ, D), struct(B, T, H, D), struct(3, B, T, HQ)
    args = (q, k, k, gates, q)
    fwd, fwd_bwd = nsa_fns(case, implementation, T, None, shape)
    row = memory_row(case, T, fwd_bwd.lower(*args))
    row["residuals"] = residuals(lambda q, k, v, g: fwd(q, k, v, g, None), args[:4])
    row["residuals_gib"] = sum(gib for _, _, gib in row["residuals"])
    return row


def splash_row(T, shape, interpret):
    """The memory row of splash's causal forward+backward at T, in its own layout (benchmarks/tpu.py's dense row)."""
    G = shape.HQ // shape.H
    _, fwd_bwd = tpu.dense_fns(tpu.splash_mask("dense", T, shape), shape, interpret)
    qs = jax.ShapeDtypeStruct((shape.B, shape.H, G, T, shape.D), jnp.bfloat16)
    ks = jax.ShapeDtypeStruct((shape.B, shape.H, T, shape.D), jnp.bfloat16)
    return memory_row("dense-splash", T, fwd_bwd.lower(qs, ks, ks, qs))


def report(row):
    """A row's sizes, its largest stored arrays and its largest residuals, printed."""
    print(json.dumps({k: v for k, v in row.items() if k not in ("residuals", "largest_buffers", "peak_live",
                                                                 "peak_trace")}), flush=True)
    for buffer in row["largest_buffers"]:
        print(f"    stored {buffer['stored_gib']:8.3f} GiB (logical {buffer['gib']:.3f})  {buffer['op']} "
              f"{buffer['name']}: {buffer['type']}", flush=True)
    for key, count, gib in row.get("residuals", [])[:12]:
        print(f"    residual {gib:8.3f} GiB  {count} x {key}", flush=True)
    for buffer in row["peak_live"]:
        print(f"    at peak {buffer['gib']:8.3f} GiB  {buffer['name']}: {buffer['type']}", flush=True)
    for line in row["peak_trace"]:
        print(f"    {line[:150]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384])
    parser.add_argument("--cases", nargs="+", default=["full"], choices=["full", "full_nowin", "paper", "paper_nowin"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    on_tpu = jax.devices()[0].platform == "tpu"
    shape, lens = (STANDARD, args.seq_lens) if on_tpu else (tpu.SMOKE, [tpu.SMOKE_SEQ_LEN])
    rows = []
    for T in lens:
        rows.append(splash_row(T, shape, interpret=not on_tpu))
        report(rows[-1])
        for case in args.cases:
            rows.append(nsa_row(case, T, shape, "pallas"))
            report(rows[-1])
    if args.out:
        with open(os.path.join(args.out, "memory-probe.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
