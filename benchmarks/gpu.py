"""The GPU benchmark: nsa's kernels (Triton, Pallas Mosaic GPU) against nsa's XLA reference, dense cuDNN attention
and fla's NSA.

    python benchmarks/gpu.py --out benchmarks/results [--seq-lens 8192 16384 ...] [--cases selection full]

Standard shape: B = 1, HQ = 64, H = 4, D = 128, bf16, block_size 64, 16 selected blocks. Cases:
  selection    selected attention with given block indices (nsa.selected_attention; fla parallel_nsa
               with block_indices);
  full         compression + top-k + selection + sliding window 512 with all three gates (fla has no
               window without flash-attn: its row is compression + top-k + selection);
  full_nowin   the same without the window (two gates);
  paper        full at the paper's compression: windows of 32 tokens every 16, selection blocks of 64
               (Eq. 9 scores);
  paper_nowin  paper without the window;
  window       the sliding window alone, beside cuDNN's own sliding window (local_window_size=(511, 0));
  selection_local, full_local
               selection and full on inputs with locality along T (benchmarks.common.smooth_inputs; selection on
               select_blocks' choice on them): what a trained model's neighbouring queries come closer to.
The selection and full rows record the union sizes of their selection (union4/union64_mean and _max: the
distinct blocks of 4 and of 64 neighbouring tokens of one KV head, against 16 per token): what a kernel that
shares key tiles between tokens loads.
--mdy PATH times mdy666's NSA (../shared/peers/mdy_side.py, copied into an ignored folder) in its own process
before nsa's rows, at every T: its rows are full_nowin (compression 64/64) and paper_nowin (32/16), without a
window because its window branch needs flash-attn (the speedup column of the _nowin cases is against them).
Each row is the median over many timed iterations after warm-up, forward and forward+backward, in
one process on one GPU. TFLOP/s count useful work only (what a perfect kernel must compute). Writes
gpu.json, gpu.md (the table) and gpu.png into --out and prints the table. fla is skipped with a note if it does not import.
--merge A.json B.json ... (no GPU) merges the gpu.json of several calls of one lease (a call stops at 600 s) into
one gpu.json, gpu.md and gpu.png.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax

if not __package__:  # run as a script (python benchmarks/gpu.py): the repo root holds the benchmarks package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa
from benchmarks.common import (LOCAL_CASES, STANDARD, case_shape, compiled_memory_gib, dense_flops,  # noqa: F401
                               implementation_of, jax_inputs, jax_timings, loss_of, measure, meta, module_versions,
                               nsa_fns, random_block_indices, run, selection_of, smooth_inputs, table, time_jax, union_sizes,
                               useful_flops, window_flops, write_json)

B, HQ, H, D, BS, S, WINDOW = STANDARD[:7]
# jax_triton clears TRITON_CACHE_DIR when it is imported; fla's Triton (its driver helpers, its
# autotuner) needs a cache directory, so the one set before the import is put back for fla.
TRITON_CACHE_DIR = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")


# the cases of one op whose auto row is the row of the family nsa._families.PREFERENCE puts first (selected
# attention's is not: implementation=None takes its forward and dq from Mosaic GPU where that claims them)
SINGLE_OPS = ("window",)


def dense_fns(window=None):
    """cuDNN's causal attention, or with `window` its own sliding window (the query and the window - 1 keys before
    it: nsa's window_size)."""
    local = None if window is None else (window - 1, 0)

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, implementation="cudnn")

    return jax.jit(forward), jax.jit(jax.grad(loss_of(forward), argnums=(0, 1, 2)))


def time_fla(case, T, idx, iters):
    os.environ["TRITON_CACHE_DIR"] = TRITON_CACHE_DIR
    os.makedirs(TRITON_CACHE_DIR, exist_ok=True)
    import torch
    import triton
    from fla.ops.nsa import parallel_nsa

    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(B, T, HQ, D).requires_grad_(), make(B, T, H, D).requires_grad_(), make(B, T, H, D).requires_grad_()
    g = [torch.sigmoid(make(B, T, HQ)).requires_grad_() for _ in range(3)]
    do = make(B, T, HQ, D)
    if case == "selection":
        indices = torch.as_tensor(idx, device="cuda").long()
        fwd = lambda: parallel_nsa(q, k, v, block_indices=indices, block_counts=S, block_size=BS)
    else:
        fwd = lambda: parallel_nsa(q, k, v, g_cmp=g[0], g_slc=g[1], block_counts=S, block_size=BS)
    grads = [q, k, v] + (g[:2] if case == "full" else [])
    fwd_bwd = lambda: torch.autograd.grad(fwd(), grads, do)
    bench = lambda f: triton.testing.do_bench(f, warmup=50, rep=max(200, 20 * iters), return_mode="median") / 1e3
    return bench(fwd), bench(fwd_bwd)


def gpu_rows(args):
    """rows_for of common.run: nsa's implementations, dense cuDNN and fla at (case, T)."""
    def rows_for(case, T):
        q, k, v, gates, do = (smooth_inputs if case in LOCAL_CASES else jax_inputs)(T)
        idx = selection_of(case, T, q, k)
        useful = useful_flops(case, T)
        union = {} if idx is None else dict(zip(("union4_mean", "union4_max", "union64_mean", "union64_max"),
                                                (*union_sizes(idx, BS, 4), *union_sizes(idx, BS, 64))))
        for impl in args.impls:
            if (impl == "xla" and T > args.xla_max_seq_len) or (impl == "auto" and case in SINGLE_OPS):
                continue
            fwd, fwd_bwd = nsa_fns(case, implementation_of(impl), T, idx)
            args_ = (q, k, v, gates, do)
            yield measure(dict(case=case, T=T, impl=f"nsa-{impl}", useful_tflop_fwd=useful / 1e12, **union),
                          jax_timings(fwd, fwd_bwd, args_, args_, args.iters))
        if not args.no_dense and case in ("selection", "full", "window"):  # dense is the same in every full case
            window = STANDARD.window if case == "window" else None
            fwd, fwd_bwd = dense_fns(window)
            flops = window_flops(T) if window else dense_flops(T)
            yield measure(dict(case=case, T=T, impl="dense-cudnn" + (" (window)" if window else ""),
                               useful_tflop_fwd=flops / 1e12),
                          jax_timings(fwd, fwd_bwd, (q, k, v), (q, k, v, do), args.iters))
        if args.no_fla or case not in ("selection", "full"):  # fla: compression blocks are selection blocks
            return
        row = dict(case=case, T=T, impl="fla" + ("" if case == "selection" else " (no window)"),
                   useful_tflop_fwd=(useful if case == "selection" else useful - window_flops(T)) / 1e12)
        yield measure(row, lambda row: row.update(zip(("fwd_ms", "fwd_bwd_ms"),
                                                      (1e3 * t for t in time_fla(case, T, idx, args.iters)))))

    return rows_for


def is_baseline_of(row, other):
    """Whether `other` is the baseline row of row's case and T (the speedup column's): fla's, mdy666's in the
    _nowin cases, cuDNN's sliding window in the window case."""
    peer = "mdy666" if row["case"].endswith("_nowin") else "dense-cudnn" if row["case"] == "window" else "fla"
    return other["case"] == row["case"] and other["T"] == row["T"] and other["impl"].startswith(peer)


def mdy_rows(path, seq_lens):
    """mdy666's NSA timed by `path` (mdy_side.py) in a process of its own, as rows of the _nowin cases."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, path, ",".join(map(str, seq_lens))], env=dict(os.environ, OUT=out),
                              capture_output=True, text=True)
        print(done.stdout + done.stderr[-3000:], flush=True)
        if done.returncode:
            raise RuntimeError(f"{path} exited {done.returncode}")
        with open(os.path.join(out, "mdy_side.json")) as f:
            side = json.load(f)
    rows = []
    for r in side["rows"]:
        case = {"mdy:64/64:nowin": "full_nowin", "mdy:32/16:nowin": "paper_nowin"}[r["case"]]
        rows.append(dict(case=case, T=r["T"], impl="mdy666 (no window)", fwd_ms=r["fwd_ms"], fwd_bwd_ms=r["fwd_bwd_ms"],
                         useful_tflop_fwd=useful_flops(case, r["T"]) / 1e12))
    return rows, dict(torch=side["torch"], triton=side["triton"])


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for impl in sorted({r["impl"] for r in rows if r["case"] == case}):
            pts = [(r["T"], r["fwd_bwd_ms"]) for r in rows if r["case"] == case and r["impl"] == impl and "error" not in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel="fwd+bwd ms", title=case)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# what two runs merged by --merge must share: one machine and software, one shape (the date may differ: a lease
# that crosses midnight)
SAME_RUN = ("device", "jax", "python", "shape", "triton", "torch", "fla", "jax_triton", "mdy666")


def merge(paths, out):
    """The rows of several gpu.json files (one device call each: a call stops at 600 s, one T of every row takes
    about that) as one: gpu.json, gpu.md (the table) and gpu.png in `out`. Their metas must agree on SAME_RUN; the
    rows keep the first file's case order, then T; the merged meta lists the dates and the files."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]["meta"]
    for path, run_ in zip(paths[1:], runs[1:]):
        differ = [k for k in SAME_RUN if run_["meta"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"{path} is not of the same run as {paths[0]}: {differ} differ")
    rows = [r for run_ in runs for r in run_["rows"]]
    order = {}
    for r in rows:
        order.setdefault(r["case"], len(order))
    rows = sorted(rows, key=lambda r: (order[r["case"]], r["T"]))
    info = dict(first, date=sorted({run_["meta"]["date"] for run_ in runs}),
                merged=[os.path.basename(p) for p in paths])
    return write_results(out, info, rows)


def write_results(out, info, rows):
    """gpu.json ({meta: info, rows}), gpu.md (the table) and gpu.png of the rows in `out`; returns the table."""
    write_json(os.path.join(out, "gpu.json"), info, rows)
    text = table(rows, "fla (mdy666 for _nowin, cuDNN's window for window)", is_baseline_of)
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(text + "\n")
    plot(rows, os.path.join(out, "gpu.png"))
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="merge these gpu.json files of one lease into --out (gpu.json, gpu.md, gpu.png); no GPU")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--cases", nargs="+", default=["selection", "full"])
    parser.add_argument("--impls", nargs="*", default=["triton", "pallas", "auto", "xla"],
                        help="nsa implementations to time (pallas: the Mosaic GPU kernels; auto: "
                             "implementation=None, the mix nsa._families.PREFERENCE picks, full case only)")
    parser.add_argument("--no-dense", action="store_true", help="skip dense cuDNN attention")
    parser.add_argument("--no-fla", action="store_true", help="skip fla")
    parser.add_argument("--xla-max-seq-len", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--mdy", help="mdy_side.py of ../shared/peers (in an ignored folder): time mdy666's NSA too")
    args = parser.parse_args()
    if args.merge:
        print(merge(args.merge, args.out))
        return
    mdy, mdy_versions = mdy_rows(args.mdy, args.seq_lens) if args.mdy else ([], None)  # before jax takes the GPU
    rows = run(args.cases, args.seq_lens, gpu_rows(args))
    order = {case: i for i, case in enumerate(args.cases)}
    rows = sorted(rows + [r for r in mdy if r["case"] in order], key=lambda r: (order[r["case"]], r["T"]))
    info = meta(**module_versions(("triton", "torch", "fla", "jax_triton")), mdy666=mdy_versions,
                paper_compression=dict(compress_block_size=32, compress_stride=16))
    text = write_results(args.out, info, rows)
    print(json.dumps(info))
    print(text)


if __name__ == "__main__":
    main()
