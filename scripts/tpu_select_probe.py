"""Block selection (`nsa.pallas.tpu.select`) alone on a TPU (issue 52): its forward as nsa.attention runs it (with
compressed attention's lse given), at the standard shape (B = 1, HQ = 64, H = 4, D = 128, bf16, selection blocks of
64) under compression windows of l tokens every d, for each count of selected blocks (--counts: 16, the standard's;
1 leaves one round of the top-k, so the difference is what the other 15 cost) and each select Config (TB tokens, BC
compressed rows per step) asked for; each Config's block ids are checked against the default Config's (they must be
equal).

    python3 scripts/tpu_select_probe.py [--seq-lens 8192 65536] [--compressions 64 64 32 16] [--counts 16 1]
                                        [--configs 128x128 128x256] [--iters 5] [--out DIR]

Off a TPU it runs at T = 512 in interpret mode to prove that it runs.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import STANDARD, meta, module_versions, time_jax  # noqa: E402
from nsa._varlen import num_compressed_blocks  # noqa: E402
from nsa.pallas.tpu import select  # noqa: E402


def inputs(T, d, seed=0):
    """q [1, T, HQ, D] and k_cmp [1, NC, H, D] (NC rows as `nsa.compress` makes them: one every d tokens) bf16, and
    an lse [1, T, HQ] float32 near what compressed attention gives normal inputs (log NC: every row about as likely).
    The rows' window length l does not change their count, only which a token sees."""
    s = STANDARD
    nc = num_compressed_blocks(T, d)
    kq, kk = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (s.B, T, s.HQ, s.D), jnp.bfloat16)
    k_cmp = jax.random.normal(kk, (s.B, nc, s.H, s.D), jnp.bfloat16)
    lse = jnp.full((s.B, T, s.HQ), np.log(nc), jnp.float32)
    return q, k_cmp, lse


def probe(T, l, d, counts, configs, iters, interpret):
    """One row per config: ms per call and whether its ids equal the default Config's."""
    q, k_cmp, lse = inputs(T, d)
    kw = dict(block_counts=counts, block_size=STANDARD.block_size, scale=STANDARD.D ** -0.5,
              compress_block_size=l, compress_stride=d, interpret=interpret)
    want = None
    rows = []
    for config in [None, *configs]:
        fn = jax.jit(lambda q, k, lse, config=config: select.forward(q, k, lse, None, config=config, **kw))
        try:
            ids = np.asarray(fn(q, k_cmp, lse))
            ms = time_jax(fn, (q, k_cmp, lse), iters) * 1e3
            want = ids if want is None else want
            row = dict(T=T, l=l, d=d, counts=counts, config=list(config) if config else "default", ms=ms,
                       equal=bool(np.array_equal(ids, want)))
        except Exception as e:  # noqa: BLE001: a config Mosaic rejects is a row, not the end of the probe
            row = dict(T=T, l=l, d=d, counts=counts, config=list(config) if config else "default", error=str(e)[:300])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--compressions", type=int, nargs="+", default=[64, 64, 32, 16])
    parser.add_argument("--counts", type=int, nargs="+", default=[STANDARD.blocks])
    parser.add_argument("--configs", nargs="*", default=[], help="TBxBC, e.g. 128x256")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    on_tpu = jax.default_backend() == "tpu"
    interpret = False if on_tpu else pltpu.InterpretParams()
    seq_lens = args.seq_lens if on_tpu else [512]
    configs = [select.Config(*map(int, c.split("x"))) for c in args.configs]
    pairs = list(zip(args.compressions[::2], args.compressions[1::2]))
    rows = [r for T in seq_lens for l, d in pairs for n in args.counts
            for r in probe(T, l, d, n, configs, args.iters, interpret)]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "select-probe.json"), "w") as f:
            json.dump(dict(meta=meta(**module_versions(["jaxlib", "libtpu"])), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
