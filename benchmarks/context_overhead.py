"""What context parallelism's code path costs on one device: nsa.attention at P = 1 (inside jax.shard_map over a
one-device mesh, context_axis="sp") against the plain call, forward and forward+backward, at the standard heads.
Issue 27's target: at most 3% at 64k on an H200.

    python benchmarks/context_overhead.py [--seq-lens 65536] [--cases full full_nowin] [--impl triton]
        [--iters 10] [--out DIR]

Writes DIR/context-overhead.json ({meta, rows}) and prints a markdown table.
"""

import argparse
import os
import sys

import jax
from jax.sharding import Mesh, PartitionSpec

if not __package__:  # run as a script: the repo root holds the benchmarks package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa
from benchmarks import common


def fns(case, implementation, T, shape, in_context):
    """(forward, forward+backward) of (q, k, v, gates, do) as `common.nsa_fns`, in a one-device context axis where
    `in_context`."""
    shape = common.case_shape(case, shape)
    kw = dict(block_counts=shape.blocks, block_size=shape.block_size, window_size=shape.window,
              implementation=implementation, **shape.compression())

    def rows(q, k, v, a, b, c):
        return nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c if shape.window else None,
                                    **kw, **(dict(context_axis="sp") if in_context else {}))

    if in_context:
        seq = PartitionSpec(None, "sp")
        rows = jax.shard_map(rows, mesh=Mesh(jax.devices()[:1], ("sp",)), in_specs=(seq,) * 6, out_specs=seq)
    forward = lambda q, k, v, g: rows(q, k, v, *g)
    fwd = jax.jit(lambda q, k, v, g, do: forward(q, k, v, g))  # do: the forward+backward's arguments, unused
    fwd_bwd = jax.jit(jax.grad(common.loss_of(forward), argnums=(0, 1, 2, 3)))
    return fwd, fwd_bwd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
    parser.add_argument("--cases", nargs="+", default=["full", "full_nowin"])
    parser.add_argument("--impl", default="triton")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    implementation = common.implementation_of(args.impl)

    def rows_for(case, T):
        q, k, v, gates, do = common.jax_inputs(T)
        for name, in_context in (("plain", False), ("context P=1", True)):
            fwd, fwd_bwd = fns(case, implementation, T, common.STANDARD, in_context)
            row = dict(case=case, T=T, impl=f"{args.impl} {name}",
                       useful_tflop_fwd=common.useful_flops(case, T) / 1e12)
            yield common.measure(row, common.jax_timings(fwd, fwd_bwd, (q, k, v, gates, do),
                                                         (q, k, v, gates, do), args.iters))

    rows = common.run(args.cases, args.seq_lens, rows_for)
    for r in rows:
        base = next((b for b in rows if b["case"] == r["case"] and b["T"] == r["T"] and "plain" in b["impl"]), None)
        if base and "error" not in r and "error" not in base and r is not base:
            r["fwd_overhead"] = r["fwd_ms"] / base["fwd_ms"] - 1
            r["fwd_bwd_overhead"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"] - 1
    os.makedirs(args.out, exist_ok=True)
    common.write_json(os.path.join(args.out, "context-overhead.json"), common.meta(), rows)
    print(common.table(rows, "plain", lambda r, b: b["case"] == r["case"] and b["T"] == r["T"]
                       and "plain" in b["impl"]))
    for r in rows:
        if "fwd_overhead" in r:
            print(f"{r['case']} T={r['T']}: P = 1 overhead fwd {100 * r['fwd_overhead']:+.1f}%, "
                  f"fwd+bwd {100 * r['fwd_bwd_overhead']:+.1f}%")


if __name__ == "__main__":
    main()
