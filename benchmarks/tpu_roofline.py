"""An on-paper roofline of nsa's Pallas TPU kernels at the standard shape, per kernel and TPU generation.

    python benchmarks/tpu_roofline.py [--seq-lens 8192 65536] [--chips v5p v6e] [--json PATH]

For each kernel it counts, from the kernel's grid and tiles, the MXU FLOPs it executes (whole tiles:
masked entries cost the same), the HBM bytes its DMAs move, the number of DMAs and the number of grid
steps, and turns each into a time on one chip:

    mxu = FLOPs / peak bf16 FLOP/s      hbm = bytes / HBM bandwidth
    dma = DMAs * DMA_ISSUE_S            steps = grid steps * GRID_STEP_S

The expected time is the largest of the four, the bound that binds. (VPU/EUP work, the softmax's exp
and select's top-k, is not modelled: the times are lower bounds.)

Kernels:
- window / compressed forward, dq and dk/dv: nsa/pallas/_flash.py as written (grid (B, HQ, T / BQ, STEPS)
  forward and dq, (B, H, NK / BK, G, QSTEPS) dk/dv; BQ = BK = 128). The grid is walked in order, and a
  block is DMA'd when its block index differs from the previous step's (the Pallas pipeline keeps an
  unchanged block, and a skipped step re-maps to the last visited tile), so K/V re-reads per query tile
  of each head, and the reuse between consecutive steps, are counted exactly.
- select, selected forward, dq and dk/dv: the design of the issue, while nsa/pallas/select.py and
  selected.py are not written: a tile of TB tokens x G heads (TB * G = 128 rows) per KV head. selected
  forward DMAs the union of the tile's selected blocks once, U blocks of [block_size, D] (U between S
  and TB * S: both ends are rows); dq likewise; dk/dv per key block over the query tiles that selected it
  (the same (tile, block) pairs, walked by block). select computes the scores of the tile against every
  visible compressed row, in tiles of BKC rows, in `passes` passes (2: lse, then scores; 1 when lse is
  given), then a top-k in VMEM (not modelled). The parameters (TB, U, BKC, passes, blocks per step) are
  arguments of `select_kernel` / `selected_kernels`, to be set to the kernels' when they land.

Layout assumption: a block whose minor dim is narrower than 128 lanes (lo/hi [BQ, 2] int32, lse / delta
[BQ, 1] float32, select's indices [TB, S] int32) occupies NARROW_LANES lanes in HBM (TPU arrays are tiled
(8, 128) in HBM), so its DMA moves rows * NARROW_LANES * itemsize bytes.
"""

import argparse
import json
import os
import sys
from typing import NamedTuple

import numpy as np

if not __package__:  # run as a script (python benchmarks/tpu_roofline.py): the repo root holds benchmarks
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import STANDARD  # noqa: E402
from nsa import _varlen  # noqa: E402


class Chip(NamedTuple):
    """Per-chip peak numbers of a TPU generation (one JAX device: v5p's two TensorCores run as one megacore
    device, and the kernels' parallel grid dims are split between them)."""

    name: str
    bf16_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    vmem_bytes: int  # per TensorCore
    smem_bytes: int  # per TensorCore


MiB = 2 ** 20
# Peak bf16 FLOP/s and HBM bandwidth per chip: Google Cloud TPU docs, https://cloud.google.com/tpu/docs/v5e
# ("197 TFLOPs", "819 GBps"), https://cloud.google.com/tpu/docs/v5p ("459 TFLOPs", "2765 GBps"),
# https://docs.cloud.google.com/tpu/docs/v6e ("918 TFLOPs", "1638 GBps"). VMEM and SMEM per TensorCore: JAX's
# table of TPU hardware, jax/_src/pallas/mosaic/tpu_info.py (pltpu.get_tpu_info(); jax 0.10.2): v5e 128 MiB
# VMEM, v5p 64 MiB, v6e 128 MiB; 1 MiB SMEM on each.
V5E = Chip("v5e", 197e12, 819e9, 128 * MiB, 1 * MiB)
V5P = Chip("v5p", 459e12, 2765e9, 64 * MiB, 1 * MiB)
V6E = Chip("v6e", 918e12, 1638e9, 128 * MiB, 1 * MiB)
CHIPS = {c.name: c for c in (V5E, V5P, V6E)}

# Fixed costs, ASSUMED (no published figure was found; measure them on the VM and update): the overhead of
# one step of a Pallas TPU grid (the pipeline's bookkeeping, semaphore waits, the scalar work of the index
# maps), ~0.35 us as quoted for Pallas TPU pipelines; and the issue cost of one DMA (descriptor set-up on
# the scalar unit, ~50 ns at ~1.5 GHz).
GRID_STEP_S = 0.35e-6
DMA_ISSUE_S = 0.05e-6
NARROW_LANES = 128
BF16, F32, I32 = 2, 4, 4  # bytes


class Kernel(NamedTuple):
    """What one call of a kernel does on the whole problem."""

    name: str
    flops: float  # MXU FLOPs executed
    hbm_bytes: float  # bytes moved by its DMAs (reads and writes)
    dmas: int
    grid_steps: int
    smem_bytes: int = 0  # scalar-prefetched tables


class Block(NamedTuple):
    """A BlockSpec operand of a walked grid: its bytes per DMA and its block index at each grid step."""

    bytes: int
    index: np.ndarray  # int64 [steps]: one number per distinct block


def dma_count(index):
    """DMAs of a block over the grid: one at the first step and one per change of its block index."""
    return int(1 + np.count_nonzero(index[1:] != index[:-1])) if index.size else 0


def walked(name, blocks, executed, flops_per_step, smem_bytes=0):
    """The Kernel of a grid walked in order (`executed` [steps] bool: the steps that compute)."""
    dmas = [dma_count(b.index) for b in blocks]
    return Kernel(name, float(np.count_nonzero(executed)) * flops_per_step,
                  float(sum(n * b.bytes for n, b in zip(dmas, blocks))), sum(dmas), int(executed.size), smem_bytes)


def cdiv(a, b):
    return -(-a // b)


def tile_bands(lo, hi, rows_per_tile, tile):
    """(first, last) tile of the other side that any of the rows of each tile of `rows_per_tile` rows sees
    (the rows see [lo, hi]; empty rows have lo > hi); (0, -1) for a tile that sees nothing
    (as nsa/pallas/_flash.py's _bands)."""
    n = cdiv(lo.size, rows_per_tile)
    pad = n * rows_per_tile - lo.size
    lo, hi = np.pad(lo, (0, pad), constant_values=1), np.pad(hi, (0, pad), constant_values=0)
    seen = (lo <= hi).reshape(n, -1)
    first = np.where(seen, lo.reshape(n, -1), np.iinfo(np.int64).max).min(1) // tile
    last = np.where(seen, hi.reshape(n, -1), -1).max(1) // tile
    any_seen = seen.any(1)
    return np.where(any_seen, first, 0), np.where(any_seen, last, -1)


def band_walk(first, last, heads, steps):
    """The grid (heads, tiles, steps) of a program per (head, tile) walking `steps` tiles of the other side
    from first[tile]: (head, tile, other tile clamped to the band, executed), each [heads * tiles * steps]."""
    h, i, j = (a.ravel() for a in np.meshgrid(np.arange(heads), np.arange(first.size), np.arange(steps),
                                                indexing="ij"))
    other = np.maximum(np.minimum(first[i] + j, last[i]), 0)
    return h, i, other, first[i] + j <= last[i]


def key(*parts):
    """One int64 per tuple of block coordinates (each < 2^20)."""
    out = np.zeros_like(parts[0], dtype=np.int64)
    for p in parts:
        out = out * (1 << 20) + p
    return out


def flash_kernels(branch, lo, hi, NK, key_span, query_span, shape=STANDARD, bq=128, bk=128):
    """Forward, dq and dk/dv of nsa/pallas/_flash.py for one branch (keys [B, NK, H, D] seen in [lo, hi])."""
    D, G, HQ, H = shape.D, shape.HQ // shape.H, shape.HQ, shape.H
    T = lo.size
    nq, nk = cdiv(T, bq), cdiv(NK, bk)
    q_tile, k_tile = bq * D * BF16, bk * D * BF16
    narrow = bq * NARROW_LANES * I32  # lo/hi [BQ, 2] int32; lse, delta [BQ, 1] float32 (same bytes)
    first, last = tile_bands(lo, hi, bq, bk)
    steps = min(cdiv(key_span, bk) + 1, nk)
    h, i, kt, executed = band_walk(first, last, HQ, steps)
    per_query = [Block(narrow, i), Block(q_tile, key(h, i))]
    kv = [Block(k_tile, key(h // G, kt)), Block(k_tile, key(h // G, kt))]
    per_query_tile = lambda n_bf16, n_narrow: [Block(q_tile, key(h, i))] * n_bf16 + [Block(narrow, key(h, i))] * n_narrow
    mm = 2 * bq * bk * D
    forward = walked(f"{branch} fwd", per_query + kv + per_query_tile(1, 1), executed, 2 * mm)  # + o, lse
    dq = walked(f"{branch} dq", per_query + kv + per_query_tile(2, 2), executed, 3 * mm)  # + do, lse, delta; dq
    # dk/dv: grid (H, NK / BK, G, QSTEPS); query tiles per key tile from the key rows' query ranges
    qfirst_rows, qlast_rows = (np.asarray(x, np.int64) for x in _varlen.query_ranges(lo, hi, NK))
    qfirst, qlast = tile_bands(qfirst_rows, qlast_rows, bk, bq)
    qsteps = min(cdiv(query_span + bk - 1, bq) + 1, nq)
    hg, n, qt, executed = band_walk(qfirst, qlast, H * G, qsteps)  # programs (h, n, g) flattened as (h*G+g, n)
    order = np.lexsort((np.arange(hg.size) % qsteps, hg % G, n, hg // G))  # grid order (h, n, g, s)
    hg, n, qt, executed = hg[order], n[order], qt[order], executed[order]
    kvh = hg // G
    blocks = ([Block(narrow, qt), Block(q_tile, key(hg, qt)), Block(k_tile, key(kvh, n)), Block(k_tile, key(kvh, n)),
               Block(q_tile, key(hg, qt)), Block(narrow, key(hg, qt)), Block(narrow, key(hg, qt))]
              + [Block(k_tile, key(kvh, n))] * 2)  # outputs dk, dv
    dkdv = walked(f"{branch} dkdv", blocks, executed, 4 * mm)
    return [forward, dq, dkdv]


def window_kernels(T, shape=STANDARD, **tiles):
    lo, hi = (np.asarray(x, np.int64) for x in _varlen.window_key_range(T, shape.window))
    return flash_kernels("window", lo, hi, T, 128 + shape.window - 1, shape.window, shape, **tiles)


def compressed_kernels(T, shape=STANDARD, **tiles):
    NC = int(_varlen.num_compressed_blocks(T, shape.block_size))
    lo, hi = (np.asarray(x, np.int64) for x in _varlen.compressed_key_range(T, NC, shape.block_size))
    return flash_kernels("compressed", lo, hi, NC, NC, T, shape, **tiles)


def select_kernel(T, shape=STANDARD, tb=8, bkc=128, passes=2):
    """select_blocks' design: per KV head, tiles of tb tokens x G heads against the visible compressed rows
    in tiles of bkc rows, `passes` times (2: lse then scores; 1 when lse is given); indices [tb, S] out."""
    D, G, H, S = shape.D, shape.HQ // shape.H, shape.H, shape.blocks
    NC = int(_varlen.num_compressed_blocks(T, shape.block_size))
    lo, hi = (np.asarray(x, np.int64) for x in _varlen.compressed_key_range(T, NC, shape.block_size))
    first, last = tile_bands(lo, hi, tb, bkc)
    rows = tb * G
    h, i, kt, executed = band_walk(first, last, H, cdiv(NC, bkc))
    one_pass = [Block(rows * D * BF16, key(h, i)), Block(bkc * D * BF16, key(h, kt))]
    lse = [Block(rows * NARROW_LANES * F32, key(h, i))] if passes == 1 else []  # given lse, read
    out = [Block(tb * NARROW_LANES * I32, key(h, i))]  # the indices
    kernel = walked("select", one_pass + lse + out, executed, 2 * rows * bkc * D)
    extra = passes - 1  # each further pass re-walks the grid and re-reads q and the compressed keys
    again = walked("", one_pass, executed, 2 * rows * bkc * D)
    return kernel._replace(name=f"select ({passes} pass{'es' if passes > 1 else ''})",
                           flops=kernel.flops + extra * again.flops, hbm_bytes=kernel.hbm_bytes + extra * again.hbm_bytes,
                           dmas=kernel.dmas + extra * again.dmas, grid_steps=kernel.grid_steps + extra * again.grid_steps)


def selected_kernels(T, union, shape=STANDARD, tb=8, blocks_per_step=1):
    """selected_attention's design: per KV head, tiles of tb tokens x G heads (tb * G rows), each visiting
    the `union` distinct [block_size, D] blocks its tokens selected (blocks_per_step per grid step), K and V
    DMA'd once per (tile, block) pair; dk/dv walks the same pairs by key block."""
    D, G, H, BS = shape.D, shape.HQ // shape.H, shape.H, shape.block_size
    rows, tiles = tb * G, H * cdiv(T, tb)
    pairs = tiles * union
    steps = tiles * cdiv(union, blocks_per_step)
    q_tile, kv_block, narrow = rows * D * BF16, BS * D * BF16, rows * NARROW_LANES * F32
    smem = tiles * union * I32  # the union table, scalar-prefetched
    mm = 2 * rows * BS * D
    label = f"U={union}"

    def kernel(name, tile_bf16, tile_narrow, matmuls):
        """Per pair: K and V; per tile: tile_bf16 [rows, D] and tile_narrow [rows, 1] blocks."""
        return Kernel(f"selected {name} ({label})", pairs * matmuls * mm,
                      2 * pairs * kv_block + tiles * (tile_bf16 * q_tile + tile_narrow * narrow),
                      2 * pairs + tiles * (tile_bf16 + tile_narrow), steps, smem)

    forward = kernel("fwd", 2, 1, 2)  # q, o; lse
    dq = kernel("dq", 3, 2, 3)  # q, do, dq; lse, delta
    # dk/dv: per pair q, do tiles, lse, delta; per key block k, v read and dk, dv written
    key_blocks = H * cdiv(T, BS)
    dkdv = Kernel(f"selected dkdv ({label})", pairs * 4 * mm,
                  pairs * (2 * q_tile + 2 * narrow) + key_blocks * 4 * kv_block, pairs * 4 + key_blocks * 4, steps, smem)
    return [forward, dq, dkdv]


def kernels(T, shape=STANDARD, tb=8, unions=None):
    """Every kernel at sequence length T; selected at each union size (default S and tb * S)."""
    unions = unions or (shape.blocks, tb * shape.blocks)
    out = window_kernels(T, shape) + compressed_kernels(T, shape) + [select_kernel(T, shape, tb, passes=2),
                                                                      select_kernel(T, shape, tb, passes=1)]
    for union in unions:
        out += selected_kernels(T, union, shape, tb)
    return out


def bounds(kernel, chip):
    """Seconds each resource needs: {mxu, hbm, dma, steps}."""
    return dict(mxu=kernel.flops / chip.bf16_flops, hbm=kernel.hbm_bytes / chip.hbm_bandwidth,
                dma=kernel.dmas * DMA_ISSUE_S, steps=kernel.grid_steps * GRID_STEP_S)


def roofline(seq_lens, chips, shape=STANDARD):
    """One row per (T, chip, kernel): its counts, its bounds in ms, the one that binds and the expected ms."""
    rows = []
    for T in seq_lens:
        for kernel in kernels(T, shape):
            for chip in chips:
                b = bounds(kernel, chip)
                binds = max(b, key=b.get)
                rows.append(dict(T=T, chip=chip.name, **kernel._asdict(), **{f"{k}_ms": 1e3 * v for k, v in b.items()},
                                 binds=binds, ms=1e3 * b[binds], smem_fits=kernel.smem_bytes <= chip.smem_bytes))
    return rows


def table(rows):
    lines = ["| T | chip | kernel | GFLOP | HBM GB | DMAs (k) | grid steps (k) | MXU ms | HBM ms | DMA ms | steps ms "
             "| binds | expected ms | SMEM table fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        smem = "-" if not r["smem_bytes"] else f"{'yes' if r['smem_fits'] else 'no'} ({r['smem_bytes'] / MiB:.2f} MiB)"
        lines.append(f"| {r['T']} | {r['chip']} | {r['name']} | {r['flops'] / 1e9:.0f} | {r['hbm_bytes'] / 1e9:.2f} | "
                     f"{r['dmas'] / 1e3:.0f} | {r['grid_steps'] / 1e3:.0f} | {r['mxu_ms']:.3f} | {r['hbm_ms']:.3f} | "
                     f"{r['dma_ms']:.3f} | {r['steps_ms']:.3f} | {r['binds']} | {r['ms']:.3f} | {smem} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--chips", nargs="+", default=["v5p", "v6e"], choices=sorted(CHIPS))
    parser.add_argument("--json", help="write the rows and the constants to this file")
    args = parser.parse_args(argv)
    rows = roofline(args.seq_lens, [CHIPS[c] for c in args.chips])
    if args.json:
        constants = dict(chips={c: CHIPS[c]._asdict() for c in args.chips}, grid_step_s=GRID_STEP_S,
                         dma_issue_s=DMA_ISSUE_S, narrow_lanes=NARROW_LANES, shape=STANDARD.describe())
        with open(args.json, "w") as f:
            json.dump(dict(constants=constants, rows=rows), f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
