"""The TPU benchmark: nsa's Pallas kernels against nsa's XLA reference and dense splash attention.

    python benchmarks/tpu.py --out benchmarks/results [--seq-lens 8192 16384 32768 65536]
        [--cases selection full dense] [--impls pallas xla] [--iters 20]
    python benchmarks/tpu.py --out DIR --smoke      # the whole script on a CPU, at a tiny shape

On a TPU VM with nsa installed from a checkout (`pip install . 'jax[tpu]'`). Standard shape of benchmarks/gpu.py: B = 1, HQ = 64,
H = 4, D = 128, bf16, block_size 64, 16 selected blocks, window 512. Cases (benchmarks.common):
  selection    selected attention with given (random) block indices: nsa.selected_attention;
  selection_local  the same on select_blocks' choice on inputs with locality along T (common.smooth_inputs);
  full         compression + top-k + selection + sliding window with all three gates: nsa.attention;
  full_nowin   the same without the window; paper, paper_nowin: at the paper's compression (l = 32, d = 16);
  full_local, full_nowin_local, paper_local, paper_nowin_local: those on inputs with locality along T;
  window       the sliding window alone (nsa.sliding_window_attention), beside splash under the window's local mask;
  compressed, compressed_paper   compressed attention alone (nsa.compressed_attention on compress's rows, made
               outside the timed function) at 64/64 and at 32/16;
  dense        causal dense attention with the same HQ, H, D (GQA): splash attention
               (jax.experimental.pallas.ops.tpu.splash_attention), the MQA kernel of each KV head's G
               query heads, vmapped over the KV heads, on [H, G, T, D] / [H, T, D] views made outside the
               timed function (its native layout), q pre-scaled by D^-0.5.
Every nsa case has a row per nsa implementation (--impls: "pallas", "xla" and "auto", implementation=None; xla only up
to --xla-max-seq-len); dense has one row. The rows run length by length (every case at the first T, then the next),
and the JSON and table are written again after each length: a run cut short keeps what it timed. Each row is the
median over --iters timed iterations after warm-up, forward and forward+backward (gradients of q, k, v and, in the
full cases, the gates), with the forward+backward's peak memory from XLA's buffer assignment. TFLOP/s count useful
work only (benchmarks/common.py). A row that fails records its error (e.g. the reference out of memory at long T);
with --smoke every error is raised instead.

Writes tpu.json (meta: date, device kind, TPU generation, jax / jaxlib / libtpu versions, shape; rows)
and tpu.md (the table) into --out, and prints the table.

--smoke runs the same code on the CPU at T = 128, HQ = 8, H = 2, D = 128, block 16, 4 blocks,
window 32, 1 iteration: nsa's implementation="pallas" runs its kernels in interpret mode off-TPU, and
splash attention gets interpret=True. It proves that the script runs; its times mean nothing.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

if not __package__:  # run as a script (python benchmarks/tpu.py): the repo root holds the benchmarks package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa
from benchmarks.common import (BRANCH_CASES, FULL_CASES, LOCAL_CASES, STANDARD, Shape, case_shape, implementation_of,
                               jax_inputs, jax_timings, loss_of, measure, meta, module_versions, nsa_fns, run,
                               selection_of, smooth_inputs, table, useful_flops, window_flops, write_json)

SMOKE = Shape(B=1, HQ=8, H=2, D=128, block_size=16, blocks=4, window=32)
SMOKE_SEQ_LEN, SMOKE_ITERS = 128, 1
CASES = ["selection", *FULL_CASES, *LOCAL_CASES, "window", *BRANCH_CASES, "dense"]
# splash attention's tiles: 512 (capped at T) for every kernel, as MaxText's defaults (sa_block_*)
SPLASH_BLOCK = 512


def tpu_generation():
    """The TPU generation of device 0 ('v5e', 'v5p', 'v6e', ...; None off-TPU), from Pallas's chip info, else
    from the device kind ('TPU v5 lite' -> 'v5e')."""
    device = jax.devices()[0]
    if device.platform != "tpu":
        return None
    try:
        from jax.experimental.pallas import tpu as pltpu
        return str(pltpu.get_tpu_info().chip_version.name).lower().replace("tpu_", "")
    except Exception:
        kind = device.device_kind.lower()
        return "v5e" if "v5 lite" in kind or "v5e" in kind else kind.replace("tpu ", "").replace(" ", "")


def splash_mask(case, T, shape):
    """Splash's mask of one query head for a case's baseline: causal [T, T] (dense), the window's local mask [T, T]
    (window), or compressed attention's [T, NCp] (nsa.pallas.tpu.compressed.CompressedMask: row i seen by query t
    iff i * d + l - 1 <= t; its NC rows padded to a multiple of 128, the padding masked)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if case == "dense":
        return splash.CausalMask((T, T))
    if case == "window":
        return splash.LocalMask((T, T), (shape.window - 1, 0), 0)
    from nsa.pallas.tpu import _splash, compressed

    l, d = shape.compress_block_size or shape.block_size, shape.stride
    rows = -(-T // d)
    return compressed.CompressedMask((T, _splash.padded_rows(rows)), block_size=l, stride=d, num_rows=rows)


def splash_kernel(mask, shape, interpret):
    """Splash attention's MQA kernel for the G = HQ / H query heads of one KV head, [G, T, D] x [KP, D], under
    `mask` [T, KP] (lengths multiples of 128); tiles of SPLASH_BLOCK, or the largest of 256, 128 dividing a length."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    G = shape.HQ // shape.H
    bq, bkv = (max(b for b in (SPLASH_BLOCK, 256, 128) if n % b == 0) for n in mask.shape)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                              block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return splash.make_splash_mqa_single_device(splash.MultiHeadMask([mask] * G), block_sizes=sizes,
                                                interpret=interpret)


def splash_layout(q, k, v, do, shape, rows=None):
    """nsa's [B, T, HQ, D] / [B, TK, H, D] as splash's [B, H, G, T, D] / [B, H, rows, D] (k, v zero-padded to
    `rows`), q scaled by D^-0.5."""
    B, T = q.shape[:2]
    G = shape.HQ // shape.H
    by_group = lambda x: x.reshape(B, T, shape.H, G, shape.D).transpose(0, 2, 3, 1, 4)
    pad = lambda x: x if rows is None else jnp.pad(x, [(0, 0), (0, rows - x.shape[1]), (0, 0), (0, 0)])
    by_head = lambda x: pad(x).transpose(0, 2, 1, 3)
    return by_group(q * shape.D ** -0.5), by_head(k), by_head(v), by_group(do)


def dense_fns(mask, shape, interpret):
    """(forward, forward+backward) jitted fns of (q, k, v[, do]) in splash's layout: the MQA kernel under `mask`
    vmapped over the KV heads and the batch."""
    forward = jax.vmap(jax.vmap(splash_kernel(mask, shape, interpret)))
    return jax.jit(forward), jax.jit(jax.grad(loss_of(forward), argnums=(0, 1, 2)))


def compressed_fns(implementation, shape):
    """(forward, forward+backward) jitted fns of (q, k_cmp, v_cmp[, do]): nsa.compressed_attention's o at the shape's
    compression, the gradient of q, k_cmp and v_cmp (lse's cotangent zero, as in nsa.attention)."""
    l, d = shape.compress_block_size or shape.block_size, shape.stride

    def forward(q, k_cmp, v_cmp):
        return nsa.compressed_attention(q, k_cmp, v_cmp, block_size=l, stride=d, implementation=implementation)[0]

    return jax.jit(forward), jax.jit(jax.grad(loss_of(forward), argnums=(0, 1, 2)))


def compressed_rows(q, k, v, shape):
    """compress's rows of k and v at the shape's compression (made outside the timed functions)."""
    l, d = shape.compress_block_size or shape.block_size, shape.stride
    return nsa.compress(k, block_size=l, stride=d), nsa.compress(v, block_size=l, stride=d)


def tpu_rows(args, shape, strict, interpret):
    """rows_for of common.run: nsa's implementations at each nsa case, splash attention at dense and beside the
    window."""
    def rows_for(case, T):
        inputs = (smooth_inputs if case in LOCAL_CASES else jax_inputs)(T, shape=shape)
        q, k, v, gates, do = inputs
        row = lambda impl, flops: dict(case=case, T=T, impl=impl, useful_tflop_fwd=flops / 1e12)
        if case in ("dense", "window", *BRANCH_CASES):  # splash attention under the case's mask
            name, flops = dict(dense=("dense-splash", useful_flops("dense", T, shape)),
                               window=("splash (window)", window_flops(T, shape))).get(
                case, ("splash (compressed)", useful_flops(case, T, shape)))
            mask = splash_mask(case, T, case_shape(case, shape) if case in BRANCH_CASES else shape)
            keys = (k, v) if case not in BRANCH_CASES else compressed_rows(q, k, v, case_shape(case, shape))
            fwd, fwd_bwd = dense_fns(mask, shape, interpret)
            qs, ks, vs, dos = splash_layout(q, *keys, do, shape, rows=mask.shape[1])
            yield measure(row(name, flops), jax_timings(fwd, fwd_bwd, (qs, ks, vs), (qs, ks, vs, dos), args.iters),
                          strict)
            if case == "dense":
                return
        idx = selection_of(case, T, q, k, shape) if LOCAL_CASES.get(case, case) == "selection" else None
        for impl in args.impls:
            if impl == "xla" and T > args.xla_max_seq_len:
                continue
            flops = useful_flops(case, T, shape)
            if case in BRANCH_CASES:
                fwd, fwd_bwd = compressed_fns(implementation_of(impl), case_shape(case, shape))
                k_cmp, v_cmp = compressed_rows(q, k, v, case_shape(case, shape))
                timings = jax_timings(fwd, fwd_bwd, (q, k_cmp, v_cmp), (q, k_cmp, v_cmp, do), args.iters)
            else:
                fwd, fwd_bwd = nsa_fns(case, implementation_of(impl), T, idx, shape)
                timings = jax_timings(fwd, fwd_bwd, inputs, inputs, args.iters)
            yield measure(row(f"nsa-{impl}", flops), timings, strict)

    return rows_for


def is_dense_of(row, other):
    """Whether `other` is the baseline of row's T (the speedup column's): splash under the branch's own mask for the
    window and compressed attention, causal dense splash for every other case."""
    if row["case"] in ("window", *BRANCH_CASES):
        return other["case"] == row["case"] and other["T"] == row["T"] and other["impl"].startswith("splash (")
    return other["impl"] == "dense-splash" and other["T"] == row["T"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--cases", nargs="+", default=["selection", "full", "dense"], choices=CASES)
    parser.add_argument("--impls", nargs="*", default=["pallas", "xla"], help="nsa implementations to time")
    parser.add_argument("--xla-max-seq-len", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--name", default="tpu", help="the files' name: NAME.json, NAME.md")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU run at T={SMOKE_SEQ_LEN} and a tiny shape, Pallas in interpret mode, errors raised")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seq_lens, args.iters = [SMOKE_SEQ_LEN], SMOKE_ITERS
    return args


def main(argv=None):
    args = parse_args(argv)
    shape = SMOKE if args.smoke else STANDARD
    interpret = jax.devices()[0].platform != "tpu"
    info = meta(shape, platform=jax.devices()[0].platform, tpu_generation=tpu_generation(), smoke=args.smoke,
                splash_interpret=interpret, **module_versions(("jaxlib", "libtpu")))
    rows_for, rows = tpu_rows(args, shape, strict=args.smoke, interpret=interpret), []
    os.makedirs(args.out, exist_ok=True)
    for T in args.seq_lens:  # length by length, written after each: a run cut short keeps what it timed
        rows += run(args.cases, [T], rows_for)
        write_json(f"{args.out}/{args.name}.json", info, rows)
        text = table(rows, "splash (causal; the window and compressed rows: under their own mask)", is_dense_of)
        with open(f"{args.out}/{args.name}.md", "w") as f:
            f.write(f"{json.dumps(info)}\n\n{text}\n")
    print(json.dumps(info))
    print(text)


if __name__ == "__main__":
    main()
