"""Where the device time of each op goes (GPU or TPU), kernel by kernel, from a jax.profiler trace.

    python -m benchmarks.trace --out DIR [--seq-lens 8192 65536] [--ops window selected ...] [--iters 5]
                               [--impl pallas] [--compression 32 16] [--hlo]

Takes the op cases of benchmarks/ops.py (standard shape, implementation --impl, "triton" unless told). For
each op it runs the forward+backward (select: the forward) once to compile, then --iters times under
jax.profiler.trace(create_perfetto_trace=True), and sums the device events of the trace by name: the
kernels by their names, XLA's fusions, sorts and copies by theirs. With --hlo it also writes the optimized HLO
of each executable traced (hlo-<op>-<T>.txt: what each fusion and copy of the trace is). Prints, per op, the
device time per run and the events that take at least 1% of it, and writes trace-<seq lens>[-<impl>].json
into --out (no suffix for triton).
"""

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time

import jax

from benchmarks.ops import add_compression_argument, compression_suffix, op_cases


def device_times(fn, args, iters):
    """{event name: microseconds per run} of the device events of `iters` runs of fn(*args)."""
    jax.block_until_ready(fn(*args))
    log_dir = tempfile.mkdtemp()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
    (path,) = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "/device:" in e["args"]["name"]}
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["pid"] in devices:
            totals[e["name"]] += e.get("dur", 0) / iters
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--ops", nargs="*", default=None, help="only these ops (default: all)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--impl", default="triton",
                        help="triton, pallas, xla, or auto (implementation=None: the per-op choice of nsa._dispatch)")
    parser.add_argument("--hlo", action="store_true",
                        help="also write each op's optimized HLO (the names of the trace's fusions and copies) "
                             "into --out as hlo-<op>-<T>.txt")
    add_compression_argument(parser)
    args = parser.parse_args()
    compression = tuple(args.compression)
    result = dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  impl=args.impl, compression=list(compression), rows=[])
    for T in args.seq_lens:
        for name, fwd, fwd_bwd, op_args in op_cases(T, args.impl, compression=compression):
            if args.ops and name not in args.ops:
                continue
            fn = fwd_bwd or fwd
            if args.hlo:  # the executable traced is the one whose optimized HLO is written
                fn = fn.lower(*op_args).compile()
                with open(f"{args.out}/hlo-{name}-{T}.txt", "w") as f:
                    f.write(fn.as_text())
            times = device_times(fn, op_args, args.iters)
            total = sum(times.values())
            print(f"\n{name} T={T} ({'fwd+bwd' if fwd_bwd else 'fwd'}): {total / 1e3:.3f} ms of device events per run")
            for event, us in times.most_common():
                if us >= 0.01 * total:
                    print(f"  {us / 1e3:8.3f} ms  {event[:110]}")
            result["rows"].append(dict(op=name, T=T, fwd_bwd=fwd_bwd is not None, total_us=total, events=dict(times)))
    tag = "-".join(map(str, args.seq_lens)) + ("" if args.impl == "triton" else f"-{args.impl}")
    tag += compression_suffix(compression)
    with open(f"{args.out}/trace-{tag}.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
