"""The GPU benchmark: nsa's kernels against nsa's XLA reference, dense cuDNN attention and fla's NSA.

    python benchmarks/gpu.py --out benchmarks/results [--seq-lens 8192 16384 ...] [--cases selection full]

Standard shape: B = 1, HQ = 64, H = 4, D = 128, bf16, block_size 64, 16 selected blocks. Cases:
  selection  selected attention with given block indices (nsa.selected_attention; fla parallel_nsa
             with block_indices);
  full       compression + top-k + selection + sliding window 512 with all three gates (fla has no
             window without flash-attn: its row is compression + top-k + selection).
Each row is the median over many timed iterations after warm-up, forward and forward+backward, in
one process on one GPU. TFLOP/s count useful work only (what a perfect kernel must compute). Writes
gpu.json and gpu.png into --out and prints the table. fla is skipped with a note if it does not import.
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import nsa

B, HQ, H, D, BS, S, WINDOW = 1, 64, 4, 128, 64, 16, 512
# jax_triton clears TRITON_CACHE_DIR when it is imported; fla's Triton (its driver helpers, its
# autotuner) needs a cache directory, so the one set before the import is put back for fla.
TRITON_CACHE_DIR = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")


def useful_flops(case, T):
    """Forward FLOPs of the useful work; forward+backward counts 3.5x (two matmuls forward, five back)."""
    selection = 4 * T * HQ * S * BS * D
    if case == "selection":
        return selection
    window = 4 * T * HQ * WINDOW * D
    compressed = 4 * T * HQ * (T // BS) / 2 * D
    scores = compressed / 2
    return selection + window + compressed + scores


def dense_flops(T):
    return 2 * T * T * HQ * D


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


def compiled_memory_gib(fn, args):
    """(peak, arguments + outputs) of a jitted fn in GiB, from XLA's buffer assignment: Triton
    kernels allocate nothing beyond their outputs, so the peak is the program's."""
    stats = fn.lower(*args).compile().memory_analysis()
    peak = getattr(stats, "peak_memory_in_bytes", 0) or (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)
    return peak / 2 ** 30, (stats.argument_size_in_bytes + stats.output_size_in_bytes) / 2 ** 30


def jax_inputs(T, seed=0, hq=HQ):
    keys = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(keys[0], (B, T, hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.bfloat16)
    gates = [jax.nn.sigmoid(jax.random.normal(key, (B, T, hq))).astype(jnp.bfloat16) for key in keys[3:6]]
    do = jax.random.normal(keys[6], (B, T, hq, D), jnp.bfloat16)
    return q, k, v, gates, do


def random_block_indices(T, seed=0):
    """16 distinct blocks per (token, KV head) among the visible ones (fewer visible: -1 padded)."""
    rng = np.random.default_rng(seed)
    current = np.arange(T) // BS
    scores = rng.random((T, H, T // BS + 1))
    scores = np.where(np.arange(T // BS + 1)[None, None, :] > current[:, None, None], -1.0, scores)
    idx = np.argsort(-scores, axis=-1)[..., :S]
    idx = np.where(np.take_along_axis(scores, idx, -1) < 0, -1, idx)
    return idx[None].astype(np.int32)


def nsa_fns(case, implementation, T, idx):
    def forward(q, k, v, g):
        if case == "selection":
            return nsa.selected_attention(q, k, v, idx, block_size=BS, implementation=implementation)
        return nsa.attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=S, block_size=BS,
                             window_size=WINDOW, implementation=implementation)

    def loss(q, k, v, g, do):
        return jnp.sum(forward(q, k, v, g).astype(jnp.float32) * do.astype(jnp.float32))

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return (lambda q, k, v, g, do: fwd(q, k, v, g)), fwd_bwd


def dense_fns():
    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def loss(q, k, v, do):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


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


def run(args):
    rows = []
    for case in args.cases:
        for T in args.seq_lens:
            idx = random_block_indices(T)
            q, k, v, gates, do = jax_inputs(T)
            useful = useful_flops(case, T)
            for impl in args.impls:
                if impl == "xla" and T > args.xla_max_seq_len:
                    continue
                row = dict(case=case, T=T, impl=f"nsa-{impl}", useful_tflop_fwd=useful / 1e12)
                try:
                    fwd, fwd_bwd = nsa_fns(case, impl, T, idx)
                    row["fwd_ms"] = 1e3 * time_jax(fwd, (q, k, v, gates, do), args.iters)
                    row["fwd_bwd_ms"] = 1e3 * time_jax(fwd_bwd, (q, k, v, gates, do), args.iters)
                    row["fwd_bwd_peak_gib"], row["fwd_bwd_io_gib"] = compiled_memory_gib(fwd_bwd, (q, k, v, gates, do))
                except Exception as e:  # recorded, not hidden: the table says what failed
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
            if not args.no_dense:
                row = dict(case=case, T=T, impl="dense-cudnn", useful_tflop_fwd=dense_flops(T) / 1e12)
                try:
                    fwd, fwd_bwd = dense_fns()
                    row["fwd_ms"] = 1e3 * time_jax(fwd, (q, k, v), args.iters)
                    row["fwd_bwd_ms"] = 1e3 * time_jax(fwd_bwd, (q, k, v, do), args.iters)
                    row["fwd_bwd_peak_gib"], row["fwd_bwd_io_gib"] = compiled_memory_gib(fwd_bwd, (q, k, v, do))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.no_fla:
                continue
            row = dict(case=case, T=T, impl="fla" + ("" if case == "selection" else " (no window)"),
                       useful_tflop_fwd=(useful if case == "selection" else useful - 4 * T * HQ * WINDOW * D) / 1e12)
            try:
                row["fwd_ms"], row["fwd_bwd_ms"] = (1e3 * t for t in time_fla(case, T, idx, args.iters))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows):
    lines = ["| case | T | implementation | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd speedup vs fla "
             "| fwd+bwd peak GiB (inputs + outputs) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['T']} | {r['impl']} | failed: {r['error'][:80]} | | | | | |")
            continue
        fla = next((f for f in rows if f["case"] == r["case"] and f["T"] == r["T"] and f["impl"].startswith("fla")
                    and "error" not in f), None)
        speedup = f"{fla['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if fla else "-"
        memory = f"{r['fwd_bwd_peak_gib']:.1f} ({r['fwd_bwd_io_gib']:.1f})" if "fwd_bwd_peak_gib" in r else "-"
        lines.append(f"| {r['case']} | {r['T']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                     f"{r['useful_tflop_fwd'] / r['fwd_ms'] * 1e3:.0f} | "
                     f"{3.5 * r['useful_tflop_fwd'] / r['fwd_bwd_ms'] * 1e3:.0f} | {speedup} | {memory} |")
    return "\n".join(lines)


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--cases", nargs="+", default=["selection", "full"])
    parser.add_argument("--impls", nargs="*", default=["triton", "xla"], help="nsa implementations to time")
    parser.add_argument("--no-dense", action="store_true", help="skip dense cuDNN attention")
    parser.add_argument("--no-fla", action="store_true", help="skip fla")
    parser.add_argument("--xla-max-seq-len", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    rows = run(args)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                python=platform.python_version(), shape=dict(B=B, HQ=HQ, H=H, D=D, block_size=BS, blocks=S,
                                                            window=WINDOW, dtype="bfloat16"))
    for name in ("triton", "torch", "fla", "jax_triton"):
        try:
            meta[name] = __import__(name).__version__
        except Exception:
            meta[name] = None
    with open(f"{args.out}/gpu.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, f"{args.out}/gpu.png")
    print(json.dumps(meta))
    print(table(rows))


if __name__ == "__main__":
    main()
