"""Where the Pallas TPU selected forward of a decode step spends its time: a probe, run on the chip.

On a TPU v5e the forward of a decode step (B = 8, 16k, standard heads: `_Layout.direct`, one token a tile) took
798 µs, 1.6 µs for each (sequence, head, block), where `tpu_dma_probe.py --heads` copies a block and runs its two
matmuls in about 0.6 µs. This times the kernel as it is, then with one piece of its per-block work replaced by
something cheaper (the results are then wrong: only the time counts), each compiled anew:
  kernel     nsa.pallas.tpu.selected as it is;
  head0      `_own_head` takes head 0's rows, a static strided load, no switch over the heads;
  no-mask    `_block` returns the buffer's rows unmasked (no zeroing of the rows past the block or the query);
  no-bias    `_block_bias` returns zeros (no comparison of the slots' names, no causal mask);
  bare       all three at once: what is left is the copies, the two matmuls and the online softmax.
  python3 scripts/tpu_selected_probe.py [--interpret] [--batch 8] [--context 16384]
On a TPU v5e, 2026-12-06 (benchmarks/results/tpu-check/tpu-selected-probe-2026-12-06.log), ns a (sequence, head,
block): kernel 1684, head0 1706, no-mask 1693, no-bias 1616, bare 1362: neither the head's extraction nor the
masking costs much, the bias about 4%; 80% of the time is left in the copies, the two matmuls and the online
softmax, which `tpu_dma_probe.py --heads` runs in about 600 ns with every copy in flight at once.
"""

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import time_jax  # noqa: E402
from nsa.pallas.tpu import selected  # noqa: E402

STEPS = 10  # calls per timed loop


def _head0(buf, slot, h):
    return buf[slot, :, 0, :]


def _unmasked(k_buf, v_buf, slot, x, last, block_size, h=None):
    if k_buf.ndim == 4:
        return selected._own_head(k_buf, slot, h), selected._own_head(v_buf, slot, h)
    return k_buf[slot], v_buf[slot]


def _no_bias(names, x, t0, *, block_size, rows):
    return jnp.zeros((names.shape[0], rows), jnp.float32)


VARIANTS = {
    "kernel": {},
    "head0": {"_own_head": _head0},
    "no-mask": {"_block": _unmasked},
    "no-bias": {"_block_bias": _no_bias},
    "bare": {"_own_head": _head0, "_block": _unmasked, "_block_bias": _no_bias},
}


@contextlib.contextmanager
def patched(changes):
    """selected's functions replaced by `changes` ({name: function}) while the block runs."""
    saved = {name: getattr(selected, name) for name in changes}
    for name, fn in changes.items():
        setattr(selected, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(selected, name, fn)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    B, TK, HQ, H, D, BS, S = args.batch, args.context, 64, 4, 128, 64, 16
    if args.interpret:
        B, TK = 1, 2048
    interpret = pltpu.InterpretParams() if args.interpret else False
    print("jax", jax.__version__, jax.devices())
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, 1, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, TK, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, TK, H, D), jnp.bfloat16)
    idx = jax.random.randint(keys[3], (B, 1, H, S), 0, TK // BS, jnp.int32)
    lens = jnp.full((B,), TK, jnp.int32)

    want = None
    for name, changes in VARIANTS.items():
        def forward(q, k, v, idx):  # a new function each time: jax caches a trace per function
            return selected.forward(q, k, v, idx, S, None, lens, block_size=BS, scale=D ** -0.5,
                                    interpret=interpret)[0]

        with patched(changes):
            one = jax.jit(forward)
            o = jax.block_until_ready(one(q, k, v, idx))
            loop = jax.jit(lambda q, k, v, idx: lax.fori_loop(  # STEPS calls, each on other blocks
                0, STEPS, lambda i, acc: acc + forward(q, k, v, (idx + i) % (TK // BS)).astype(jnp.float32),
                jnp.zeros(q.shape, jnp.float32)))
            us = time_jax(loop, (q, k, v, idx), args.iters) * 1e6 / STEPS
        want = o if want is None else want
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - want.astype(jnp.float32))))
        blocks = B * H * S
        print(f"{name:8}: {us:8.1f} us a call, {us / blocks * 1e3:6.0f} ns a (sequence, head, block); "
              f"max |o - kernel's o| {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
