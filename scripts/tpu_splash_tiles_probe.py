"""Which tiles the window and compressed branches should give splash attention on a TPU (issue 52): the same
`benchmarks/tpu.py` rows with nsa's splash tiles (`nsa.pallas.tpu._splash.SPLASH_BLOCKS`, the largest dividing the
padded length is taken, for queries and keys alike) patched to each variant, one process.

Why it may pay: under the window's local mask a query block of bq rows sees the keys of [q0 - W + 1, q0 + bq - 1], so
with W = 512 and blocks of 512 each query block computes two key blocks for one block's worth of visible scores
(50%); blocks of 256 compute three of 256 (67%), of 128 five of 128 (80%), at 2x and 4x the grid steps. The
baselines (splash's own rows, `benchmarks.tpu.SPLASH_BLOCK`) keep blocks of 512 in every variant.

    python3 scripts/tpu_splash_tiles_probe.py [--variants 512 256 128] [--out DIR] [benchmarks/tpu.py arguments]

Default benchmark arguments: --seq-lens 8192 --cases window compressed compressed_paper full --impls pallas --iters 3.
Writes tpu-tiles{variant}.json and .md per variant into --out. Off a TPU: benchmarks/tpu.py's --smoke shape.
"""

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks import tpu  # noqa: E402
from nsa.pallas.tpu import _splash  # noqa: E402

VARIANTS = {"512": (512, 256, 128), "256": (256, 128), "128": (128,)}  # the first is nsa's SPLASH_BLOCKS
DEFAULT_BENCH = ["--seq-lens", "8192", "--cases", "window", "compressed", "compressed_paper", "full", "--impls",
                 "pallas", "--iters", "3"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args, bench = parser.parse_known_args()
    if jax.devices()[0].platform != "tpu":
        bench = ["--smoke", "--cases", "window", "compressed", "--impls", "pallas"]
    original = _splash.SPLASH_BLOCKS
    for name in args.variants:
        _splash.SPLASH_BLOCKS = VARIANTS[name]
        try:
            tpu.main([*(bench or DEFAULT_BENCH), "--out", args.out, "--name", f"tpu-tiles{name}"])
        finally:
            _splash.SPLASH_BLOCKS = original


if __name__ == "__main__":
    main()
