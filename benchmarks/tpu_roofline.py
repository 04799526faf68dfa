"""An on-paper roofline of nsa's Pallas TPU kernels at the standard shape, per kernel and TPU generation.

    python benchmarks/tpu_roofline.py [--seq-lens 8192 65536] [--chips v5p v6e] [--json PATH]

For each kernel it counts, from the kernel's grid and tiles, the MXU FLOPs it executes (whole tiles:
masked entries cost the same), the HBM bytes its DMAs move, the number of DMAs and the number of grid
steps, and turns each into a time on one chip:

    mxu = FLOPs / peak bf16 FLOP/s      hbm = bytes / HBM bandwidth
    dma = DMAs * DMA_ISSUE_S            steps = grid steps * GRID_STEP_S

The expected time is the largest of the four, the bound that binds. The peaks are published figures;
GRID_STEP_S (0.35 us) and DMA_ISSUE_S (50 ns) are ASSUMPTIONS, not measurements, and at this shape they
bind almost every kernel: the step and DMA times scale with them. Nothing here was timed on a TPU.

Kernels, all modelled as written, with the tiles of each module's default_config at the shape:
- window / compressed forward, dq and dk/dv: nsa/pallas/tpu/_flash.py (grid (B, HQ, T / BQ, STEPS) forward
  and dq, (B, H, NK / BK, G, QSTEPS) dk/dv; BQ = BK = 128). The grid is walked in order, and a block is
  DMA'd when its block index differs from the previous step's (the Pallas pipeline keeps an unchanged
  block, and a skipped step re-maps to the last visited tile), so K/V re-reads per query tile of each
  head, and the reuse between consecutive steps, are counted exactly.
- select: nsa/pallas/tpu/select.py (`select_kernel`), grid (B, H, T / TB, PASSES * STEPS), TB = 128 tokens x
  G heads against chunks of BC = 128 compressed rows, walked like _flash's grid (BlockSpec pipelining).
  PASSES = 1 when compressed attention's lse is given (nsa.attention with g_cmp passes it), 2 without
  (select_blocks alone); both are rows. Its top-k (S rounds of VPU sweeps over the tile's chunk ranks) is
  VPU work, not modelled.
- selected: nsa/pallas/tpu/selected.py (`selected_kernels`): forward and dq on grid (B, H, T / TB) (TB = 16
  tokens x G = 16 heads = 256 rows), each step walking its tile's union of blocks with a manual
  double-buffered make_async_copy loop (one block's K and V per iteration, U per tile); dk/dv on the
  static grid of segments of at most L = min(256, NT) (tile) entries of one block; the reduce kernel
  on one step per block. The union U_i of tile i depends on the data, so each selected kernel has two
  rows, the ends of its range: U=S (all tokens of the tile select the same blocks, U_i = min(S, n_i))
  and U=min(TB*S,blocks) (no two tokens share one, U_i = min(TB * S, n_i)), n_i the blocks the tile's
  tokens can see (causal); the dk/dv and reduce counts also depend on which blocks (`tile_unions`).
  Random selections (benchmarks/tpu.py) sit near the second end; the forced blocks (0, current,
  previous), shared by a tile's tokens, pull real ones toward the first.

Not modelled (the times are lower bounds): VPU/EUP work (exp, masks, select's top-k); the latency of a
DMA: the selected loops keep one block's copy in flight while the previous block computes (at the
standard shape ~17 to 34 MFLOP, tens of ns of MXU), so a DMA latency above that makes them latency-bound
(count the loop iterations: pairs = DMAs / 2 of the manual copies); the XLA work around the kernels
(compress, selected's layouts, sorts and gathers, delta, the gates). `totals` adds the kernels of one
nsa.attention call (forward; forward + backward), as they run one after another.

Layout assumption: a block whose minor dim is narrower than 128 lanes (lo/hi [BQ, 2] int32, lse / delta
[BQ, 1] float32, select's token rows [TB, 1], lse [TB, G] and ids [TB, S], selected's names [TB, S]
int32 and lse / delta [G, TB, 1] float32) occupies NARROW_LANES lanes in HBM (TPU arrays are tiled (8,
128) in HBM), so its DMA moves rows * NARROW_LANES * itemsize bytes. It weighs most on selected's dk/dv,
which copies lse and delta per entry: 2 * R * 128 * 4 bytes against q's and do's 2 * R * 128 * 2.
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
from nsa import _device, _varlen  # noqa: E402
from nsa._config import Shapes  # noqa: E402
from nsa.pallas.tpu import _flash  # noqa: E402
from nsa.pallas.tpu import select as pallas_select  # noqa: E402
from nsa.pallas.tpu import selected as pallas_selected  # noqa: E402


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
    smem_bytes: int = 0  # SMEM it holds: scalar-prefetched tables, or the per-step rows (double-buffered)
    vmem_bytes: int = 0  # VMEM per grid step: its module's vmem_bytes (the largest of the module's kernels)


class Block(NamedTuple):
    """A BlockSpec operand of a walked grid: its bytes per DMA and its block index at each grid step."""

    bytes: int
    index: np.ndarray  # int64 [steps]: one number per distinct block


def dma_count(index):
    """DMAs of a block over the grid: one at the first step and one per change of its block index."""
    return int(1 + np.count_nonzero(index[1:] != index[:-1])) if index.size else 0


def walked(name, blocks, executed, flops_per_step, smem_bytes=0, vmem_bytes=0):
    """The Kernel of a grid walked in order (`executed` [steps] bool: the steps that compute)."""
    dmas = [dma_count(b.index) for b in blocks]
    return Kernel(name, float(np.count_nonzero(executed)) * flops_per_step,
                  float(sum(n * b.bytes for n, b in zip(dmas, blocks))), sum(dmas), int(executed.size), smem_bytes,
                  vmem_bytes)


def cdiv(a, b):
    return -(-a // b)


def tile_bands(lo, hi, rows_per_tile, tile):
    """(first, last) tile of the other side that any of the rows of each tile of `rows_per_tile` rows sees
    (the rows see [lo, hi]; empty rows have lo > hi); (0, -1) for a tile that sees nothing
    (as nsa/pallas/tpu/_flash.py's _bands)."""
    n = cdiv(lo.size, rows_per_tile)
    pad = n * rows_per_tile - lo.size
    lo, hi = np.pad(lo, (0, pad), constant_values=1), np.pad(hi, (0, pad), constant_values=0)
    seen = (lo <= hi).reshape(n, -1)
    first = np.where(seen, lo.reshape(n, -1), np.iinfo(np.int64).max).min(1) // tile
    last = np.where(seen, hi.reshape(n, -1), -1).max(1) // tile
    any_seen = seen.any(1)
    return np.where(any_seen, first, 0), np.where(any_seen, last, -1)


def band_walk(first, last, heads, steps, passes=1):
    """The grid (heads, tiles, passes * steps) of a program per (head, tile) walking `steps` tiles of the
    other side from first[tile], `passes` times: (head, tile, other tile clamped to the band, executed), each
    [heads * tiles * passes * steps]."""
    h, i, j = (a.ravel() for a in np.meshgrid(np.arange(heads), np.arange(first.size), np.arange(passes * steps),
                                                indexing="ij"))
    j = j % steps
    other = np.maximum(np.minimum(first[i] + j, last[i]), 0)
    return h, i, other, first[i] + j <= last[i]


def key(*parts):
    """One int64 per tuple of block coordinates (each < 2^20)."""
    out = np.zeros_like(parts[0], dtype=np.int64)
    for p in parts:
        out = out * (1 << 20) + p
    return out


def flash_kernels(branch, lo, hi, NK, key_span, query_span, shape=STANDARD, bq=128, bk=128):
    """Forward, dq and dk/dv of nsa/pallas/tpu/_flash.py for one branch (keys [B, NK, H, D] seen in [lo, hi])."""
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
    vmem = _flash.vmem_bytes(D, D, BF16, _flash.Config(bq, bk))
    common = dict(smem_bytes=2 * nq * I32, vmem_bytes=vmem)  # the key band per query tile, scalar-prefetched
    forward = walked(f"{branch} fwd", per_query + kv + per_query_tile(1, 1), executed, 2 * mm, **common)  # + o, lse
    dq = walked(f"{branch} dq", per_query + kv + per_query_tile(2, 2), executed, 3 * mm, **common)  # + do, lse, delta
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
    dkdv = walked(f"{branch} dkdv", blocks, executed, 4 * mm, smem_bytes=2 * nk * I32, vmem_bytes=vmem)
    return [forward, dq, dkdv]


def window_kernels(T, shape=STANDARD, **tiles):
    lo, hi = (np.asarray(x, np.int64) for x in _varlen.window_key_range(T, shape.window))
    return flash_kernels("window", lo, hi, T, 128 + shape.window - 1, shape.window, shape, **tiles)


def compressed_kernels(T, shape=STANDARD, **tiles):
    NC = int(_varlen.num_compressed_blocks(T, shape.block_size))
    lo, hi = (np.asarray(x, np.int64) for x in _varlen.compressed_key_range(T, NC, shape.block_size))
    return flash_kernels("compressed", lo, hi, NC, NC, T, shape, **tiles)


def _structs(T, shape):
    """ShapeDtypeStructs of q, k (= v), k_cmp and block_indices at `shape` (bf16): what the modules'
    default_config take."""
    import jax
    import jax.numpy as jnp
    B, HQ, H, D = shape.B, shape.HQ, shape.H, shape.D
    NC = int(_varlen.num_compressed_blocks(T, shape.block_size))
    return (jax.ShapeDtypeStruct((B, T, HQ, D), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, NC, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, H, shape.blocks), jnp.int32))


def select_config(T, shape=STANDARD):
    """nsa/pallas/tpu/select.py's default_config at `shape`: (TB, BC)."""
    q, _, k_cmp, _ = _structs(T, shape)
    shapes = Shapes.of(q, k_cmp, block_counts=shape.blocks, block_size=shape.block_size)  # TK: NC rows to see
    return pallas_select.default_config(shapes, q.dtype, _device.facts("tpu"))


def selected_config(T, shape=STANDARD):
    """nsa/pallas/tpu/selected.py's default_config at `shape`: (TB, L)."""
    q, k, _, idx = _structs(T, shape)
    shapes = Shapes.of(q, k, block_counts=idx.shape[3], block_size=shape.block_size)
    return pallas_selected.default_config(shapes, q.dtype, _device.facts("tpu"))


def select_kernel(T, shape=STANDARD, lse=True, config=None):
    """nsa/pallas/tpu/select.py as written. Grid (B, H, NT, PASSES * STEPS) (NT = T / TB, STEPS = R / BC chunks
    of BC compressed rows, R = NC rounded up to BC; PASSES = 1 when compressed attention's lse is given,
    as nsa.attention passes it, else 2); tile i walks the chunks 0 .. (its last token's current block) //
    BC, a step past them re-maps to the last (no DMA) and is skipped. BlockSpecs: the token rows (3, TB, 1)
    int32 and q (TB, G * Dp) per tile, k_cmp (BC, Dp) per chunk, lse (TB, G) float32 per tile when given;
    out: the ids (TB, S) int32 per tile. Per executed step and pass, G logits matmuls [TB, Dp] x [Dp, BC].
    SMEM: the band (first, last chunk per tile), scalar-prefetched."""
    D, G, H, BS = shape.D, shape.HQ // shape.H, shape.B * shape.H, shape.block_size
    tb, bc = config or select_config(T, shape)
    NC = int(_varlen.num_compressed_blocks(T, BS))
    nt, steps = cdiv(T, tb), cdiv(NC, bc)
    slots = min(shape.blocks, cdiv(T, BS))
    passes = 1 if lse else 2
    t = np.arange(T, dtype=np.int64)
    first, last = tile_bands(np.zeros(T, np.int64), t // BS, tb, bc)  # rows first .. current block, per token
    h, i, chunk, executed = band_walk(first, np.minimum(last, steps - 1), H, steps, passes)
    dp = cdiv(D, 128) * 128
    blocks = [Block(3 * tb * NARROW_LANES * I32, i), Block(tb * G * dp * BF16, key(h, i)),
              Block(bc * dp * BF16, key(h, chunk))]
    if lse:
        blocks.append(Block(tb * cdiv(G, NARROW_LANES) * NARROW_LANES * F32, key(h, i)))
    blocks.append(Block(tb * cdiv(slots, NARROW_LANES) * NARROW_LANES * I32, key(h, i)))  # the ids, written
    vmem = pallas_select.vmem_bytes(G, D, BF16, NC, slots, pallas_select.Config(tb, bc))
    name = "select (lse given, 1 pass)" if lse else "select (no lse, 2 passes)"
    return walked(name, blocks, executed, 2 * G * tb * bc * dp, smem_bytes=2 * nt * I32, vmem_bytes=vmem)


UNIONS = {"same": "U=S", "distinct": "U=min(TB*S,blocks)"}


def tile_unions(T, end, shape=STANDARD, tb=16):
    """The blocks each query tile of selected's kernels walks, at one end of the data-dependent range:
    a list of int64 arrays (block ids), one per tile of TB tokens. A tile may list its tokens' visible
    blocks, n_i = (its last token's current block) + 1; 'same' (all its tokens select the same blocks,
    U_i = min(S, n_i)): its n_i - U_i .. n_i - 1 (the most recent); 'distinct' (no two tokens share a block,
    U_i = min(TB * S, n_i)): U_i blocks spread evenly over 0 .. n_i - 1. Which blocks (not how many) only
    sets how the dk/dv lists split into segments."""
    S, BS = shape.blocks, shape.block_size
    out = []
    for i in range(cdiv(T, tb)):
        n = (min((i + 1) * tb, T) - 1) // BS + 1
        if end == "same":
            u = min(S, n)
            out.append(np.arange(n - u, n, dtype=np.int64))
        else:
            u = min(tb * S, n)
            out.append(np.arange(u, dtype=np.int64) * n // u)
    return out


def selected_kernels(T, end, shape=STANDARD, config=None):
    """nsa/pallas/tpu/selected.py as written, with each tile's union at one end ('same' or 'distinct',
    `tile_unions`). A tile is R = G * TB MXU rows; a block copies BR rows (block_size rounded up to the
    sublane tile) into a key buffer of BK rows (block_size rounded up to 128), and its matmuls take all BK.
    - fwd, dq: grid (B, H, NT). BlockSpecs per step: the tile's SMEM row (1 + 2 U_max ints; U_max =
      min(TB * S, NC)), q (G, TB, Dp), the names (TB, S) int32 (+ dq: do, lse, delta (G, TB, 1) float32);
      out o (G, TB, Dp) and lse (fwd) or dq. In the step, a manual double-buffered make_async_copy loop
      over the union: K and V of each block, 2 DMAs of [BR, Dp]. Per block 2 (fwd) or 3 (dq) matmuls of
      [R, Dp] x [Dp, BK].
    - dkdv: grid (NSEG,), NSEG = B * H * NC lists + cdiv(B * H * NT * U_max, L), static (the segments past
      the real ones are empty steps that still write their zero partials). Per step: its SMEM row (4 + 2L
      ints) and its partial dk, dv [BR, Dp] float32 written (BlockSpecs); per real segment the block's K
      and V (2 DMAs) and per entry (tile) 5 DMAs: q, do, lse, delta, names, each a tile; 4 matmuls per entry.
    - reduce: grid (B * H * NC,): per step an SMEM row (2 ints) and dk, dv [BR, Dp] float32 written; per
      real segment of the list 2 DMAs of its partials. No MXU work (VPU adds).
    The real segments are sum over lists of cdiv(len, L), from the tiles' unions (`tile_unions`).
    """
    D, G, H, S, BS = shape.D, shape.HQ // shape.H, shape.B * shape.H, shape.blocks, shape.block_size
    tb, seg = config or selected_config(T, shape)
    R, dp = G * tb, cdiv(D, 128) * 128
    br, bk = pallas_selected._copied_rows(BS, "bfloat16"), cdiv(BS, 128) * 128  # rows copied, rows multiplied
    nt, NR = cdiv(T, tb), int(_varlen.num_compressed_blocks(T, BS))
    u_max = min(tb * S, NR)
    unions = tile_unions(T, end, shape, tb)
    pairs = H * sum(u.size for u in unions)  # (tile, block) pairs: fwd and dq blocks, dk/dv entries
    lengths = np.bincount(np.concatenate(unions), minlength=NR)  # tiles per block, per head
    segments = H * int(np.sum(-(-lengths // seg)))
    nseg, lists = H * NR + cdiv(H * nt * u_max, seg), H * NR
    q_tile, kv_block, part = R * dp * BF16, br * dp * BF16, br * dp * F32
    narrow, names = R * NARROW_LANES * F32, tb * cdiv(S, NARROW_LANES) * NARROW_LANES * I32
    row = lambda ints: cdiv(ints, NARROW_LANES) * NARROW_LANES * I32
    mm = 2 * R * bk * dp
    vmem = pallas_selected.vmem_bytes(G, D, D, BF16, BS, S, pallas_selected.Config(tb, seg))
    label = UNIONS[end]
    smem = 2 * (1 + 2 * u_max) * I32  # one row per step, double-buffered

    def query_grid(name, per_step, matmuls):
        """fwd or dq: per_step [bytes] of its BlockSpec blocks, then 2 DMAs of a block per pair."""
        steps = H * nt
        return Kernel(f"selected {name} ({label})", float(pairs * matmuls * mm),
                      float(steps * sum(per_step) + 2 * pairs * kv_block), steps * len(per_step) + 2 * pairs, steps,
                      smem, vmem)

    forward = query_grid("fwd", [row(1 + 2 * u_max), q_tile, names, q_tile, narrow], 2)  # + o, lse
    dq = query_grid("dq", [row(1 + 2 * u_max), q_tile, names, q_tile, narrow, narrow, q_tile], 3)  # do, lse, delta; dq
    entry = [q_tile, q_tile, narrow, narrow, names]
    dkdv = Kernel(f"selected dkdv ({label})", float(pairs * 4 * mm),
                  float(nseg * (row(4 + 2 * seg) + 2 * part) + segments * 2 * kv_block + pairs * sum(entry)),
                  nseg * 3 + segments * 2 + pairs * len(entry), nseg, 2 * (4 + 2 * seg) * I32, vmem)
    reduce = Kernel(f"selected reduce ({label})", 0.0, float(lists * (row(2) + 2 * part) + segments * 2 * part),
                    lists * 3 + segments * 2, lists, 2 * 2 * I32, vmem)
    return [forward, dq, dkdv, reduce]


def kernels(T, shape=STANDARD, ends=tuple(UNIONS)):
    """Every kernel at sequence length T: window, compressed, select with and without lse, and selected at
    each end of its union's range (`tile_unions`)."""
    out = window_kernels(T, shape) + compressed_kernels(T, shape) + [select_kernel(T, shape, lse=True),
                                                                      select_kernel(T, shape, lse=False)]
    for end in ends:
        out += selected_kernels(T, end, shape)
    return out


# What nsa.attention (all three branches, compressed attention's lse passed to select) runs, per union end
# ({U}: the label): its forward, and what the backward adds (select has no gradient).
FORWARD = ("window fwd", "compressed fwd", "select (lse given, 1 pass)", "selected fwd ({U})")
BACKWARD = ("window dq", "window dkdv", "compressed dq", "compressed dkdv", "selected dq ({U})",
            "selected dkdv ({U})", "selected reduce ({U})")


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


def totals(rows):
    """nsa.attention's kernels summed (they run one after another), per (T, chip, union end): forward and
    forward+backward expected ms. The XLA work around the kernels (compress, the selected layouts, sorts
    and gathers, delta, the gating) is not counted."""
    ms = {(r["T"], r["chip"], r["name"]): r["ms"] for r in rows}
    out = []
    for T, chip in dict.fromkeys((r["T"], r["chip"]) for r in rows):
        for label in UNIONS.values():
            fwd = sum(ms[T, chip, name.format(U=label)] for name in FORWARD)
            bwd = sum(ms[T, chip, name.format(U=label)] for name in BACKWARD)
            out.append(dict(T=T, chip=chip, union=label, fwd_ms=fwd, fwd_bwd_ms=fwd + bwd))
    return out


def table(rows):
    lines = ["| T | chip | kernel | GFLOP | HBM GB | DMAs (k) | grid steps (k) | MXU ms | HBM ms | DMA ms | steps ms "
             "| binds | expected ms | VMEM/step MiB | SMEM fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        smem = "-" if not r["smem_bytes"] else f"{'yes' if r['smem_fits'] else 'no'} ({r['smem_bytes'] / 1024:.1f} KiB)"
        lines.append(f"| {r['T']} | {r['chip']} | {r['name']} | {r['flops'] / 1e9:.0f} | {r['hbm_bytes'] / 1e9:.2f} | "
                     f"{r['dmas'] / 1e3:.0f} | {r['grid_steps'] / 1e3:.1f} | {r['mxu_ms']:.3f} | {r['hbm_ms']:.3f} | "
                     f"{r['dma_ms']:.3f} | {r['steps_ms']:.3f} | {r['binds']} | {r['ms']:.3f} | "
                     f"{r['vmem_bytes'] / MiB:.2f} | {smem} |")
    return "\n".join(lines)


def totals_table(total_rows):
    lines = ["| T | chip | selected union | nsa.attention fwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['chip']} | {r['union']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} |"
              for r in total_rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--chips", nargs="+", default=["v5p", "v6e"], choices=sorted(CHIPS))
    parser.add_argument("--json", help="write the rows and the constants to this file")
    args = parser.parse_args(argv)
    rows = roofline(args.seq_lens, [CHIPS[c] for c in args.chips])
    total_rows = totals(rows)
    if args.json:
        constants = dict(chips={c: CHIPS[c]._asdict() for c in args.chips}, grid_step_s=GRID_STEP_S,
                         dma_issue_s=DMA_ISSUE_S, narrow_lanes=NARROW_LANES, shape=STANDARD.describe())
        with open(args.json, "w") as f:
            json.dump(dict(constants=constants, rows=rows, totals=total_rows), f, indent=1)
    print(table(rows))
    print()
    print(totals_table(total_rows))


if __name__ == "__main__":
    main()
