"""The TPU benchmark: nsa's Pallas kernels against nsa's XLA reference and dense splash attention.

    python benchmarks/tpu.py --out benchmarks/results [--seq-lens 8192 16384 32768 65536]
        [--cases selection full dense] [--impls pallas xla] [--iters 20]
    python benchmarks/tpu.py --out DIR --smoke      # the whole script on a CPU, at a tiny shape

On a TPU VM with nsa installed from a checkout (`pip install . 'jax[tpu]'`). Standard shape of benchmarks/gpu.py: B = 1, HQ = 64,
H = 4, D = 128, bf16, block_size 64, 16 selected blocks, window 512. Cases:
  selection  selected attention with given (random) block indices: nsa.selected_attention;
  full       compression + top-k + selection + sliding window with all three gates: nsa.attention;
  dense      causal dense attention with the same HQ, H, D (GQA): splash attention
             (jax.experimental.pallas.ops.tpu.splash_attention), the MQA kernel of each KV head's G
             query heads, vmapped over the KV heads, on [H, G, T, D] / [H, T, D] views made outside the
             timed function (its native layout), q pre-scaled by D^-0.5.
selection and full have a row per nsa implementation (--impls: "pallas" and "xla"; xla only up to
--xla-max-seq-len); dense has one row. Each row is the median over --iters timed iterations after
warm-up, forward and forward+backward (gradients of q, k, v and, in full, the gates). TFLOP/s count
useful work only (benchmarks/common.py). A row that fails records its error (e.g. the reference out of
memory at long T); with --smoke every error is raised instead.

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

if not __package__:  # run as a script (python benchmarks/tpu.py): the repo root holds the benchmarks package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (STANDARD, Shape, jax_inputs, jax_timings, loss_of, measure, meta, module_versions,
                               nsa_fns, random_block_indices, run, table, useful_flops, write_json)

SMOKE = Shape(B=1, HQ=8, H=2, D=128, block_size=16, blocks=4, window=32)
SMOKE_SEQ_LEN, SMOKE_ITERS = 128, 1
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


def splash_kernel(T, shape, interpret):
    """Splash attention's causal MQA kernel for the G = HQ / H query heads of one KV head, [G, T, D] x [T, D]."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    G = shape.HQ // shape.H
    block = min(SPLASH_BLOCK, T)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((T, T)) for _ in range(G)])
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_layout(q, k, v, do, shape):
    """nsa's [B, T, HQ, D] / [B, T, H, D] as splash's [B, H, G, T, D] / [B, H, T, D], q scaled by D^-0.5."""
    B, T = q.shape[:2]
    G = shape.HQ // shape.H
    by_group = lambda x: x.reshape(B, T, shape.H, G, shape.D).transpose(0, 2, 3, 1, 4)
    by_head = lambda x: x.transpose(0, 2, 1, 3)
    return by_group(q * shape.D ** -0.5), by_head(k), by_head(v), by_group(do)


def dense_fns(T, shape, interpret):
    """(forward, forward+backward) jitted fns of (q, k, v[, do]) in splash's layout: the MQA kernel vmapped over
    the KV heads and the batch."""
    kernel = splash_kernel(T, shape, interpret)
    forward = jax.vmap(jax.vmap(kernel))
    return jax.jit(forward), jax.jit(jax.grad(loss_of(forward), argnums=(0, 1, 2)))


def tpu_rows(args, shape, strict, interpret):
    """rows_for of common.run: nsa's implementations at selection and full, splash attention at dense."""
    def rows_for(case, T):
        q, k, v, gates, do = jax_inputs(T, shape=shape)
        row = lambda impl: dict(case=case, T=T, impl=impl, useful_tflop_fwd=useful_flops(case, T, shape) / 1e12)
        if case == "dense":
            fwd, fwd_bwd = dense_fns(T, shape, interpret)
            qs, ks, vs, dos = splash_layout(q, k, v, do, shape)
            yield measure(row("dense-splash"), jax_timings(fwd, fwd_bwd, (qs, ks, vs), (qs, ks, vs, dos), args.iters),
                          strict)
            return
        idx = random_block_indices(T, shape=shape)
        for impl in args.impls:
            if impl == "xla" and T > args.xla_max_seq_len:
                continue
            fwd, fwd_bwd = nsa_fns(case, impl, T, idx, shape)
            inputs = (q, k, v, gates, do)
            yield measure(row(f"nsa-{impl}"), jax_timings(fwd, fwd_bwd, inputs, inputs, args.iters), strict)

    return rows_for


def is_dense_of(row, other):
    """Whether `other` is the dense row of row's T (the speedup column's baseline)."""
    return other["case"] == "dense" and other["T"] == row["T"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--cases", nargs="+", default=["selection", "full", "dense"],
                        choices=["selection", "full", "dense"])
    parser.add_argument("--impls", nargs="*", default=["pallas", "xla"], help="nsa implementations to time")
    parser.add_argument("--xla-max-seq-len", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
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
    rows = run(args.cases, args.seq_lens, tpu_rows(args, shape, strict=args.smoke, interpret=interpret))
    info = meta(shape, platform=jax.devices()[0].platform, tpu_generation=tpu_generation(), smoke=args.smoke,
                splash_interpret=interpret, **module_versions(("jaxlib", "libtpu")))
    write_json(f"{args.out}/tpu.json", info, rows)
    text = table(rows, "dense splash", is_dense_of)
    with open(f"{args.out}/tpu.md", "w") as f:
        f.write(f"{json.dumps(info)}\n\n{text}\n")
    print(json.dumps(info))
    print(text)


if __name__ == "__main__":
    main()
