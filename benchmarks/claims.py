"""What implementation=None's run-time claims cost and save on the GPU (nsa.pallas.gpu.CLAIMS), in one process.

    python -m benchmarks.claims --out DIR [--seq-lens 8192 65536] [--cases full full_local] [--rounds 3]
                                [--min-dq-tokens N]

Times the forward+backward of benchmarks/gpu.py's cases (standard shape) under four dispatches of selected
attention, compiled side by side and timed round-robin (--rounds rounds of --iters runs each; the median of all):
  triton          implementation="triton";
  auto            implementation=None: Mosaic GPU's forward and dq where they claim the inputs;
  auto-forward    implementation=None with the forward's claim alone (the dq claim removed);
  auto-dq-never   implementation=None with a dq claim whose test is traced but never holds: the cost of the
                  backward's lax.cond itself.
--min-dq-tokens sets nsa.pallas.gpu.selected.MIN_DQ_TOKENS, below which the dq claim is a static False (0: the
claim is tested at every T).
Writes claims-<T...>.json into --out.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import LOCAL_CASES, jax_inputs, nsa_fns, smooth_inputs


def never(residuals, do, **static):
    """A traced test that never holds."""
    return jnp.sum(residuals[-1][:1, :1, :1]) != jnp.sum(residuals[-1][:1, :1, :1])


def variants():
    """{name: (implementation, CLAIMS of nsa.pallas.gpu while it is traced)}."""
    from nsa.pallas import gpu

    claims = dict(gpu.CLAIMS)
    forward = {key: claim for key, claim in claims.items() if key[1] == 0}
    dq_never = forward | {("selected", 1): claims[("selected", 1)]._replace(test=never)}
    return {"triton": ("triton", claims), "auto": (None, claims), "auto-forward": (None, forward),
            "auto-dq-never": (None, dq_never)}


def compiled(case, T, inputs):
    """{variant: its jitted forward+backward, compiled on inputs}."""
    from nsa.pallas import gpu

    saved = dict(gpu.CLAIMS)
    fns = {}
    try:
        for name, (implementation, claims) in variants().items():
            gpu.CLAIMS.clear()
            gpu.CLAIMS.update(claims)
            jax.clear_caches()  # no trace of another variant's dispatch is reused
            _, fwd_bwd = nsa_fns(case, implementation, T, None)
            fns[name] = fwd_bwd.lower(*inputs).compile()
    finally:
        gpu.CLAIMS.clear()
        gpu.CLAIMS.update(saved)
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--cases", nargs="+", default=["full", "full_local"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--min-dq-tokens", type=int, default=None)
    args = parser.parse_args()
    if args.min_dq_tokens is not None:
        from nsa.pallas.gpu import selected
        selected.MIN_DQ_TOKENS = args.min_dq_tokens
    rows = []
    for T in args.seq_lens:
        for case in args.cases:
            inputs = (smooth_inputs if case in LOCAL_CASES else jax_inputs)(T)
            fns = compiled(case, T, inputs)
            times = {name: [] for name in fns}
            for fn in fns.values():
                jax.block_until_ready(fn(*inputs))
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    for _ in range(args.iters):
                        start = time.perf_counter()
                        jax.block_until_ready(fn(*inputs))
                        times[name].append(time.perf_counter() - start)
            for name, ts in times.items():
                rows.append(dict(case=case, T=T, variant=name, fwd_bwd_ms=1e3 * statistics.median(ts),
                                 fwd_bwd_min_ms=1e3 * min(ts)))
                print(json.dumps(rows[-1]), flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    meta["min_dq_tokens"] = args.min_dq_tokens
    with open(os.path.join(args.out, "claims-" + "-".join(map(str, args.seq_lens)) + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
