"""A paper model of context parallelism (nsa.context): bytes moved and compute per device per layer, one training
step (forward and backward) of attention(..., context_axis=...) at the standard heads.

    python benchmarks/context_model.py [--out benchmarks/results]   # prints the table, writes context-model.json

What the step does per layer (nsa/context.py): all-gather k and v (bf16) in the forward; under jax.checkpoint the
backward gathers them again and recomputes the forward; dk and dv (float32) are reduce-scattered. Per device, with
a ring all-gather, each of those moves (P - 1) / P of the whole array: (2 + 2) * T * H * D * 2 bytes of k and v
gathered and 2 * T * H * D * 4 bytes of dk, dv scattered.

Compute per device: its T / P queries, each attending (as the ops do, causal on average) T / (2 d) compressed rows,
S * l' selected keys and W window keys, for each of HQ query heads: 4 * HQ * D FLOPs a key in the forward (q k^T
and p v), twice that in the backward, and the forward again (the recompute): 4 forwards. Time at RATE FLOP/s, an
assumption (about a third of the H200's dense bf16 peak: what a sparse attention kernel sustains), stated in the
output. The links: NVLink (an H200's 450 GB/s each way, BUS_EFFICIENCY of it in a ring) and 400 Gb/s networking
(50 GB/s). Where the collectives take longer than the compute, all-gather stops hiding behind it: the point where
a ring (k and v passed block by block while the local queries attend) should take over, and the gathered k, v of
one layer per device (the memory all-gather costs) is listed beside.
"""

import argparse
import json
import os

HQ, H, D = 64, 4, 128  # the standard heads (benchmarks.common.STANDARD)
BLOCK, SELECTED, WINDOW, STRIDE = 64, 16, 512, 16  # l', S, W and the paper's d (l = 32, d = 16)
RATE = 300e12  # sustained attention FLOP/s on an H200: an assumption
LINKS = {"NVLink": 450e9, "400Gb/s": 50e9}  # bytes/s each way per device
BUS_EFFICIENCY = 0.8  # of a link's bandwidth a ring collective reaches
TOKENS = [256 * 1024, 1024 * 1024, 4 * 1024 * 1024]
DEVICES = [2, 4, 8, 64]


def row(T, P):
    """The model's numbers for a sequence of T tokens over P devices."""
    kv = T * H * D * 2 * 2  # k and v, bf16
    moved = (P - 1) / P * (2 * kv + 2 * kv)  # gathered in the forward and again in the backward, dk dv in float32
    keys = T / (2 * STRIDE) + SELECTED * BLOCK + WINDOW  # keys a query attends, on average
    flops = 4 * (T / P) * keys * 4 * HQ * D  # 4 forwards' worth: forward, backward (2), recompute
    compute_ms = 1e3 * flops / RATE
    out = dict(T=T, P=P, bytes_moved_GB=moved / 1e9, gathered_kv_GB=kv / 1e9, tflops=flops / 1e12,
               compute_ms=compute_ms)
    for link, bandwidth in LINKS.items():
        comm_ms = 1e3 * moved / (bandwidth * BUS_EFFICIENCY)
        out[f"{link}_ms"] = comm_ms
        out[f"{link}_hidden"] = comm_ms <= compute_ms
    return out


def table(rows):
    lines = ["| T | P | moved GB | gathered k, v GB | TFLOP | compute ms | NVLink ms | 400Gb/s ms |",
             "|---|---|---|---|---|---|---|---|"]
    mark = lambda r, link: f"{r[f'{link}_ms']:.1f}" + ("" if r[f"{link}_hidden"] else " (exposed)")
    for r in rows:
        lines.append(f"| {r['T'] // 1024}k | {r['P']} | {r['bytes_moved_GB']:.2f} | {r['gathered_kv_GB']:.2f} | "
                     f"{r['tflops']:.1f} | {r['compute_ms']:.1f} | {mark(r, 'NVLink')} | {mark(r, '400Gb/s')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [row(T, P) for T in TOKENS for P in DEVICES]
    print(table(rows))
    if args.out:
        meta = dict(heads=dict(HQ=HQ, H=H, D=D), block=BLOCK, selected=SELECTED, window=WINDOW, stride=STRIDE,
                    rate_flops=RATE, links_bytes_per_s=LINKS, bus_efficiency=BUS_EFFICIENCY)
        with open(os.path.join(args.out, "context-model.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
