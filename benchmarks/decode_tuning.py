"""The decode step's split heuristics, A/B on the GPU: which programs-per-SM targets and merge tile to keep.

    python benchmarks/decode_tuning.py [--iters 3]

Times nsa.attention's fused decode step (benchmarks/decode.py's chained loop, standard heads) at B = 1, 16 and 64
over TK = 65536 and at B = 1 over 524288, for each variant of (nsa.triton.decode.PROGRAMS_PER_SM,
nsa.triton.decode_select.PROGRAMS_PER_SM, nsa.triton.decode.FOLD_COLS, FOLD_SPLITS: the tile in which the last
selected split merges every branch); prints one JSON line per time.
"""

import argparse
import json
import os
import sys

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode import STEPS, cache_arrays, chained, nsa_step  # noqa: E402
from benchmarks.common import time_jax  # noqa: E402
from nsa.triton import decode, decode_select  # noqa: E402

VARIANTS = [(1, 4, 64, 4), (1, 4, 128, 2), (1, 4, 32, 8), (1, 2, 64, 4), (2, 4, 64, 4)]
SHAPES = [(1, 65536), (16, 65536), (64, 65536), (1, 524288)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    for B, TK in SHAPES:
        q, gates, k, v, k_cmp, v_cmp, lens = cache_arrays(B, TK, False)
        for attn, sel, cols, splits in VARIANTS:
            decode.PROGRAMS_PER_SM, decode_select.PROGRAMS_PER_SM = attn, sel
            decode.FOLD_COLS, decode.FOLD_SPLITS = cols, splits
            fn = chained(nsa_step("triton"))
            us = 1e6 * time_jax(fn, (q, *gates, k, v, k_cmp, v_cmp, lens), args.iters) / STEPS
            print(json.dumps(dict(B=B, TK=TK, programs_per_sm=attn, select_programs_per_sm=sel, fold_cols=cols,
                                  fold_splits=splits,
                                  step_us=round(us, 1))), flush=True)


if __name__ == "__main__":
    main()
