"""Selected attention (the fine-grained branch) as Pallas TPU (Mosaic) kernels: forward, dq and a
deterministic dk/dv.

The contract is nsa.reference.selected's: query t of KV head h, at in-sequence position p, with its G =
HQ / H query heads, attends to the tokens at in-sequence positions <= p of the blocks listed in
block_indices[b, t, h, :count] (count = block_counts[b, t, h]). Entries < 0 or > p // block_size are
skipped and never read; a block listed twice is attended twice; a query that sees nothing gets o = 0,
lse = -inf and zero gradients. p = t, or with a KV cache (kv_lens int32 [B]) p = kv_lens[b] - T + t: the
T queries are the last tokens of sequence b, whose keys are the rows of k, v [B, TK, H, D] (TK >= T; the
rows past kv_lens[b] hold anything, NaN included, and never reach a result).

Naming. A block is named by its first token's global row x = sequence start + block * block_size (its row
in k), so the same in-sequence id in two packed sequences names two blocks; each skipped slot is named -1.
Each query token has a key row too, that of its own token: t + sequence offset (kv_lens[b] - T with a
cache, else 0); token j of tile i is row t0 + j, t0 = i * TB + that offset.

Layouts (all built in XLA around the kernels; D padded to Dp, a multiple of 128 lanes, T to Tp = NT * TB):
- query side, per tile of TB consecutive tokens: q [B, H, NT, G, TB, Dkp], do, o [.., Dvp], dq, and lse,
  delta [B, H, NT, G, TB, 1] float32. A (G, TB, Dp) block flattens to [G * TB, Dp] for free (TB is a
  multiple of the sublane tile), so one tile is R = G * TB MXU rows (row g * TB + j: head g, token j);
- names [B, H, NT, TB, S] int32: the name of each slot of each token of the tile;
- the tile's blocks [B, H, NT, 1, 2 + 2U + 2 * pieces * U] int32: how many distinct blocks the tile's tokens
  list, t0, then those names in increasing order (the union; U = min(min(T, TB) * S, NR) bounds it, NR = the
  block rows of one (b, h): cdiv(TK, block_size), or packed), then the key row of the last token of the tile
  that lists each (rows past it are never seen), then where each is copied from in k's HBM array: a (batch row
  or page, row) pair per piece (one piece, but for a paged cache whose pages are smaller than a block). It is
  sorted in XLA, and each grid step gets only its own row in SMEM (a BlockSpec in SMEM): the whole table
  (B * H * NT * (2 + 4U) ints) would not fit in SMEM's 1 MiB at long T;
- k [B, H, TK + BR, Dkp], v [.., Dvp] stay in HBM (memory_space HBM: with ANY, XLA may place an array that fits
  in VMEM, where Mosaic refuses a copy from a row not a multiple of the sublane tile, seen on a TPU v5e; with
  packed sequences, whose blocks start anywhere, [B, H, NR * BR, Dp]: each block's rows at a multiple of BR,
  `_key_rows`, so that every copy starts at a row Mosaic can prove aligned): a kernel copies a block's BR rows
  (block_size rounded up to the sublane tile) from its source row (its name x, or its place when packed) into
  the first rows of a VMEM buffer of BK rows (block_size rounded up to 128) itself (`make_async_copy`); rows
  past the block, or past every query of the tile, are zeroed (`_block`). With a KV cache whose TK rows
  outnumber the NT * U * BR rows the tiles' unions can name (a decode step: 1 tile, U = T * S), the forward
  reads only those (O(T * S * block_size) per KV head, never a transpose of the cache): from the cache as it
  is, k [B, TK, H, Dk] in HBM (`_Layout.direct`: TK a multiple of block_size, D of 128), each copy a block's
  block_size rows of every head, [block_size, H, D] (whole tiles of the cache's TPU layout, whose minor dims
  are H and D: Mosaic refuses a copy of one head, an offset inside a tile, seen on a TPU v5e), into buffers
  [2, BK, H, D] whose own head the kernel then takes (`_own_head`); H times the bytes of the head's
  rows, but no XLA gather of them first, which took a third of a step's time on a TPU v5e
  (scripts/tpu_dma_probe.py). A paged cache's decode step (`paged_forward`) copies the same way from its pools
  [P, S, H, D] as they are, each block from the page the page table names (or, with pages smaller than a block,
  from each of the block_size / S pages it spans, one copy each): the SMEM row gives every copy its (page, row).
  Else those rows gathered from the cache in XLA, [B, H, NT * U * BR, Dp]
  (`_gathered_rows`), block u of tile i at source row (i * U + u) * BR. BK makes every logits tile [R, BK]
  and every transpose in the dk/dv kernel (R and BK multiples of 128) lane-aligned: Mosaic has rejected
  matmuls with fewer than 128 result lanes and padded transposes (jax issues 18388, 18370), and the MXU is
  128 wide anyway.

Forward (`_fwd_kernel`), grid (B, H, NT), all parallel. A step owns a tile: it loads q (R, Dkp) (flattened
in XLA; a decode step's one token is a tile of TB = 1, its G heads the R rows) and the names (TB, S) through
BlockSpecs, then walks the tile's union in order with a double-buffered DMA loop (`_pipelined`: block u + 1's
keys and values are in flight while block u is computed). Row (g, j) sees key row x + c of block x iff
token j lists x (m > 0 times), c < block_size and x + c <= its key row t0 + j; log(m) is added to its
logits, so a block listed twice weighs twice. Online softmax in float32.

Backward. delta = sum(o * do) in XLA. `_dq_kernel` runs on the forward's grid and loop, recomputing p from
lse. dk/dv inverts the selection (fla's decomposition): each (tile, union block) pair is an entry keyed
by (b, h, block row); a stable sort in XLA makes, for each block row, the list of the tiles that selected
it, in tile order. The lists are very uneven (block 0 and the current block are in every tile's union),
so each is cut into segments of at most L entries (like nsa/triton/selected.py): `_dkdv_kernel`, grid
(NSEG,), copies its block's keys and values once, then walks its entries' tiles with the DMA loop (q, do,
lse, delta, names: one tile each) and writes float32 partial dk and dv of its block; `_reduce_kernel`,
grid (lists,), adds a list's partials in segment order (DMA loop again); XLA gathers each key row's sum.
No atomics and a fixed order everywhere: dk and dv are bitwise repeatable.

VMEM per step (`vmem_bytes`, every BlockSpec block double-buffered, 1-wide and int32 blocks padded to
128 lanes; Mosaic's own temporaries such as the [R, BK] logits come on top): the dq kernel, the largest,
holds q (G, TB, Dkp), do (G, TB, Dvp), lse, delta, names (TB, S), dq, two key and value buffers of BK
rows and a float32 [R, Dkp] accumulator; the dk/dv kernel the same tiles (its own DMA double buffers),
one block, and float32 dk, dv [BR, Dp]. At the standard shape (G = 16, TB = 16, bf16, Dp = 128,
block_size 64) that is about 1.1 MiB; float32 heads of 256 take 1.6 MiB at G = 16 and 4 MiB at G = 3
(TB = 128), bf16 heads of 256 at G = 64 6.3 MiB: all under the 16 MiB of scoped VMEM. A direct forward's
block buffers hold every head, [2, BK, H, D] with H padded to the sublane tile: 1 MiB for k and v at the
standard shape (H = 4 of 16 rows, bf16), 4 MiB at H = 32. SMEM per step: one table row of
2 + 2U + 2 * pieces * U ints (forward, dq) or 6 + 2L (dk/dv), double-buffered. None of it depends on T or TK,
which set only the grids, the lists (B * H * NR of them) and the XLA work (k and v are copied, transposed, once
per call, but for the forward of a decode step).

The Mosaic kernels carry names: selected_forward, selected_dq, selected_dkdv (the partials) and
selected_dkdv_reduce; the resident ones (for training, below) selected_resident_forward and
selected_resident_backward, or, where its one pass does not fit in VMEM, selected_resident_backward_dq_dk and
selected_resident_backward_dv.
"""

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nsa._config import Shapes, as_sequences, expect, positive, validated
from nsa._device import facts
from nsa._plan import (NONE, PAST, Tiling, block_names, check_selected, kernel_delta, padded, per_key_row,
                       row_offsets, segments, tile_lists, tile_names, tile_starts, tile_unions)
from nsa._varlen import cdiv, round_up
from nsa.pallas._batch import per_sequence
from nsa.pallas.tpu._common import dot, lane_padded, lanes, out_struct, params, sublanes

MXU_ROWS = 128  # a tile's rows (the G heads of TB tokens) are a multiple of one MXU pass


@validated
class Config(NamedTuple):
    """TB query tokens per tile (forward, dq, and the dk/dv entries) and L, the most entries (tiles) of
    one dk/dv segment. TB must be a multiple of the sublane tile (8, or 16 in 16-bit dtypes), and on a
    TPU G * TB a multiple of 128 (`default_config`); interpret mode takes any multiple of 8. TB = 1 is the
    forward's tile of a decode step's one token (its G heads the tile's rows: `default_config(forward=True)`).
    """

    tokens: int
    segment: int

    def check(self):
        positive(self, "tokens", "segment")
        expect(self.tokens == 1 or self.tokens % facts("tpu").sublanes == 0, self, "tokens",
               "1 or a multiple of the sublanes (8)")


def default_config(shapes: Shapes, dtype, device, *, forward=False) -> Config:
    """The Config of a call of `shapes` (q [B, T, HQ, Dk] against k [B, TK, H, Dk]) in `dtype` on `device`;
    forward: for the forward alone, which at T = 1 (a decode step) takes TB = 1, its tile's R = G rows its one
    token's heads (no transposes there, and a 16-token tile would be 15/16 padding).

    - TB: the fewest tokens whose G heads make R = G * TB rows a multiple of MXU_ROWS = 128, rounded up
      to the sublane tile of q's dtype (8 rows in float32, 16 in 16-bit) so that the (G, TB, Dp) tile
      flattens for free: 128 at G = 1 and 3, 8 (float32) or 16 (bfloat16) at G = 16. R is at least one
      MXU pass, and a multiple of 128 keeps the dk/dv kernel's p^T and ds^T [BK, R] transposes aligned.
      More tokens would only widen the union of blocks a tile walks.
    - L: a list holds at most NT entries (one per tile), so L = min(256, NT): short sequences never
      split; long ones split the long lists (block 0's holds all NT tiles) into segments of 256 tiles,
      each a grid step long enough to hide its block's copy, while the float32 partials stay small
      (NL + E / L of them, [BR, Dp] each: about 50 MiB for dk at the standard shape with random
      selections, where a tile's union holds every block).
    Not measured on a TPU yet (none here): benchmarks/tpu_roofline.py models the kernels at these tiles.
    """
    del device
    tb = round_up(MXU_ROWS // math.gcd(shapes.G, MXU_ROWS), sublanes(dtype))
    return Config(tokens=1 if forward and shapes.T == 1 else tb, segment=max(1, min(256, cdiv(shapes.T, tb))))


# ------------------------------------------------------------------------------------------ kernels


def _pipelined(n, copies, body):
    """for u in range(n): body(u, slot), once the copies `copies(u, slot)` (a list of async copy
    descriptors into buffer `slot` in {0, 1}) have landed; those of u + 1 fly while body(u) runs."""

    @pl.when(n > 0)
    def _first():
        for c in copies(0, 0):
            c.start()

    def step(u, carry):
        slot = lax.rem(u, 2)

        @pl.when(u + 1 < n)
        def _next():
            for c in copies(u + 1, 1 - slot):
                c.start()

        for c in copies(u, slot):
            c.wait()
        body(u, slot)
        return carry

    lax.fori_loop(0, n, step, 0)


def _copied_rows(block_size, dtype):
    """BR: the rows copied per block, block_size rounded up to the sublane tile of `dtype` (an aligned
    copy destination)."""
    return round_up(block_size, sublanes(dtype))


def _block_copies(k_hbm, v_hbm, k_buf, v_buf, sems, h, sources, slot, block_size, align):
    """The copies of one block's key and value rows into the first rows of buffer `slot` of k_buf and v_buf, from
    sources, its pieces' (batch row or page, row) pairs (`_sources`). align: what a row is known to be a multiple of
    (`_Layout.align`), said to Mosaic, which compiles a copy from a tiled HBM array only at rows it can prove aligned
    to its 8-row tile: BR rows of KV head h, from k_hbm [B, H, rows, Dkp] into buffers [., BK, Dkp]. From a KV cache
    as it is (`_Layout.direct`: k_hbm [B, TK, H, Dk], or a paged cache's pool [P, S, H, Dk]; buffers [., BK, H, D]):
    every head's rows, whole tiles of the cache's minor dims (H, D), block_size / pieces rows from each source into
    consecutive rows of the buffer (a block whose rows span several pages is several copies, one semaphore)."""
    if k_buf.ndim == 4:
        piece = block_size // len(sources)
        return [pltpu.make_async_copy(src.at[at, pl.ds(row, piece)], buf.at[slot, pl.ds(j * piece, piece)],
                                      sems.at[i, slot])
                for j, (at, row) in enumerate(sources) for i, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]
    [(b, x)] = sources
    rows = pl.ds(0, _copied_rows(block_size, k_buf.dtype))
    src = pl.ds(pl.multiple_of(x, align) if align > 1 else x, rows.size)
    return [pltpu.make_async_copy(k_hbm.at[b, h, src], k_buf.at[slot, rows], sems.at[0, slot]),
            pltpu.make_async_copy(v_hbm.at[b, h, src], v_buf.at[slot, rows], sems.at[1, slot])]


def _block_bias(names, x, t0, *, block_size, rows):
    """[TB, BK] float32: how the TB tokens of a tile, at key rows t0 + j (names [TB, S]: their slots), see
    block x: log(m) where token j lists x m > 0 times and sees key row x + c (c < block_size and
    x + c <= t0 + j), -inf elsewhere."""
    listed = jnp.sum((names == x).astype(jnp.float32), axis=1, keepdims=True)  # [TB, 1]
    shape = (names.shape[0], rows)
    c = lax.broadcasted_iota(jnp.int32, shape, 1)
    token = t0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    seen = (listed > 0) & (c < block_size) & (x + c <= token)
    return jnp.where(seen, jnp.log(jnp.maximum(listed, 1.0)), -jnp.inf)


def _own_head(buf, slot, h):
    """[BK, D]: KV head h's rows of buffer `slot` of buf [., BK, H, D] (h traced: a switch over the heads, each
    branch one strided load)."""
    return lax.switch(h, [functools.partial(lambda j: buf[slot, :, j, :], j) for j in range(buf.shape[2])])


def _block(k_buf, v_buf, slot, x, last, block_size, h=None):
    """The keys [BK, Dkp] and values [BK, Dvp] of block x in buffer `slot` (of KV head h where the buffers hold
    every head's, [., BK, H, D]), with the rows no token of the tile sees (past the block, or past `last`, the key
    row of the last token of the tile listing it) zeroed: they hold another block's or sequence's rows, a cache's
    rows past the sequence (possibly never meant to be read) or stale VMEM past BR, and 0 * NaN would leak into
    p v and do v^T."""
    c = lax.broadcasted_iota(jnp.int32, (k_buf.shape[1], 1), 0)
    keep = (c < block_size) & (x + c <= last)
    if k_buf.ndim == 4:
        k, v = _own_head(k_buf, slot, h), _own_head(v_buf, slot, h)
    else:
        k, v = k_buf[slot], v_buf[slot]
    return jnp.where(keep, k, jnp.zeros_like(k)), jnp.where(keep, v, jnp.zeros_like(v))


def _logits(q, k, bias, scale, precision):
    """The logits of the tile q [G * TB, Dkp] against one block k [BK, Dkp] with its bias [TB, BK], as
    [G, TB, BK] float32."""
    s = dot(q, k, precision, transpose_b=True) * scale
    return s.reshape(q.shape[0] // bias.shape[0], *bias.shape) + bias[None]


def _walk_union(blocks_ref, names, k_hbm, v_hbm, k_buf, v_buf, sems, body, *, block_size, align, pieces):
    """body(k, v, bias) for each block of the step's token tile's union, in order: t0, the union's names, last
    key rows and sources (`pieces` (batch row or page, row) pairs each) from the step's SMEM row blocks_ref
    [1, 2 + 2U + 2 * pieces * U], the tile's slot names [TB, S]; block u + 1's copy flies while block u is
    computed (`_pipelined`)."""
    h = pl.program_id(1)
    U = (blocks_ref.shape[1] - 2) // (2 + 2 * pieces)

    def copies(u, slot):
        at = 2 + 2 * U + 2 * pieces * u
        sources = [(blocks_ref[0, at + 2 * j], blocks_ref[0, at + 2 * j + 1]) for j in range(pieces)]
        return _block_copies(k_hbm, v_hbm, k_buf, v_buf, sems, h, sources, slot, block_size, align)

    def step(u, slot):
        x = blocks_ref[0, 2 + u]
        bias = _block_bias(names, x, blocks_ref[0, 1], block_size=block_size, rows=k_buf.shape[1])
        body(*_block(k_buf, v_buf, slot, x, blocks_ref[0, 2 + U + u], block_size, h), bias)

    _pipelined(blocks_ref[0, 0], copies, step)


def _fwd_kernel(blocks_ref, q_ref, names_ref, k_hbm, v_hbm, o_ref, lse_ref, k_buf, v_buf, sems, m_scr, l_scr,
                acc_scr, *, scale, block_size, precision, align, pieces):
    """One tile: q_ref (R, Dkp), its R = G * TB rows (head g, token j: row g * TB + j) laid out in XLA (no
    reshape in the kernel: at TB = 1 one would gather (G, 1) tiles), o_ref (R, Dvp), lse_ref (R, 1); m, l
    [R, 128] and acc [R, Dvp] float32."""
    q = q_ref[...]
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def attend(k, v, bias):
        s = dot(q, k, precision, transpose_b=True) * scale + _row_bias(bias, q.shape[0])  # [R, BK]
        m_prev = m_scr[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no NaN
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use)
        l_scr[...] = jnp.broadcast_to(l_scr[...][:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True), l_scr.shape)
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        acc_scr[...] = acc_scr[...] * alpha + dot(p.astype(v.dtype), v, precision)

    _walk_union(blocks_ref, names_ref[...], k_hbm, v_hbm, k_buf, v_buf, sems, attend, block_size=block_size,
                align=align, pieces=pieces)
    l = l_scr[...][:, :1]
    seen = l > 0
    o_ref[...] = (acc_scr[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_scr[...][:, :1] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _row_bias(bias, rows):
    """A tile's bias [TB, BK] per token as [rows, BK] per row (row g * TB + j: token j): itself at TB = 1 (it
    broadcasts), else G copies stacked (TB a multiple of the sublane tile: a free reshape)."""
    TB, BK = bias.shape
    return bias if TB == 1 else jnp.broadcast_to(bias[None], (rows // TB, TB, BK)).reshape(rows, BK)


def _probabilities(q, k, bias, lse, scale, precision):
    """p [G, TB, BK] float32 of the tile q [G * TB, Dkp] against the block k, recomputed from lse
    [G, TB, 1] (0 where a row sees nothing)."""
    s = _logits(q, k, bias, scale, precision)
    return jnp.where(s > -jnp.inf, jnp.exp(s - jnp.where(lse > -jnp.inf, lse, 0.0)), 0.0)


def _dlogits(p, do, v, delta, precision):
    """ds = p * (do v^T - delta), [G * TB, BK] float32, for p [G, TB, BK], do [G * TB, Dvp], v [BK, Dvp],
    delta [G, TB, 1]."""
    dp = dot(do, v, precision, transpose_b=True).reshape(p.shape)
    return (p * (dp - delta)).reshape(do.shape[0], p.shape[2])


def _dq_kernel(blocks_ref, q_ref, names_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, dq_ref, k_buf, v_buf, sems,
               acc_scr, *, scale, block_size, precision, align, pieces):
    G, TB, _ = q_ref.shape
    q = q_ref[...].reshape(G * TB, q_ref.shape[2])
    do = do_ref[...].reshape(G * TB, do_ref.shape[2])
    lse, delta = lse_ref[...], delta_ref[...]
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(k, v, bias):
        p = _probabilities(q, k, bias, lse, scale, precision)
        ds = _dlogits(p, do, v, delta, precision)
        acc_scr[...] += dot(ds.astype(k.dtype), k, precision)

    _walk_union(blocks_ref, names_ref[...], k_hbm, v_hbm, k_buf, v_buf, sems, step, block_size=block_size,
                align=align, pieces=pieces)
    dq_ref[...] = (acc_scr[...] * scale).reshape(dq_ref.shape).astype(dq_ref.dtype)


def _dkdv_kernel(seg_ref, k_hbm, v_hbm, q_hbm, do_hbm, lse_hbm, delta_hbm, names_hbm, dk_ref, dv_ref, k_buf,
                 v_buf, q_buf, do_buf, lse_buf, delta_buf, names_buf, sems, *, scale, block_size, precision, align):
    """One segment, seg_ref [1, 6 + 2L] = (b, h, x, n, the offset of batch row b's key rows, the row of k_hbm
    block x is copied from (`_copy_rows`), the tiles of its L entries, the key row of the last token of each that
    lists x; n of them used): float32 partial dk and dv [BR, Dp] of block x (dk unscaled)."""
    b, h, x, n, offset = seg_ref[0, 0], seg_ref[0, 1], seg_ref[0, 2], seg_ref[0, 3], seg_ref[0, 4]
    L = (seg_ref.shape[1] - 6) // 2
    _, G, TB, _ = q_buf.shape
    dk_ref[...] = jnp.zeros(dk_ref.shape, jnp.float32)
    dv_ref[...] = jnp.zeros(dv_ref.shape, jnp.float32)

    @pl.when(n > 0)
    def _copy_block():
        copies = _block_copies(k_hbm, v_hbm, k_buf, v_buf, sems, h, [(b, seg_ref[0, 5])], 0, block_size, align)
        for c in copies:
            c.start()
        for c in copies:
            c.wait()

    def copies(u, slot):
        tile = seg_ref[0, 6 + u]
        return [pltpu.make_async_copy(src.at[b, h, tile], buf.at[slot], sems.at[2 + j, slot])
                for j, (src, buf) in enumerate([(q_hbm, q_buf), (do_hbm, do_buf), (lse_hbm, lse_buf),
                                                (delta_hbm, delta_buf), (names_hbm, names_buf)])]

    def step(u, slot):
        q = q_buf[slot].reshape(G * TB, q_buf.shape[3])
        do = do_buf[slot].reshape(G * TB, do_buf.shape[3])
        t0 = seg_ref[0, 6 + u] * TB + offset
        bias = _block_bias(names_buf[slot], x, t0, block_size=block_size, rows=k_buf.shape[1])
        k, v = _block(k_buf, v_buf, 0, x, seg_ref[0, 6 + L + u], block_size)
        p = _probabilities(q, k, bias, lse_buf[slot], scale, precision)
        ds = _dlogits(p, do, v, delta_buf[slot], precision)
        rows = dk_ref.shape[0]  # BR of the BK rows: those of the block
        dv_ref[...] += dot(p.reshape(G * TB, p.shape[2]).T.astype(do.dtype), do, precision)[:rows]
        dk_ref[...] += dot(ds.T.astype(q.dtype), q, precision)[:rows]

    _pipelined(n, copies, step)


def _reduce_kernel(list_ref, dk_hbm, dv_hbm, dk_ref, dv_ref, dk_buf, dv_buf, sems):
    """One list, list_ref [1, 2] = (its first segment, its number of segments): the sum of its partials in
    segment order."""
    first = list_ref[0, 0]
    dk_ref[...] = jnp.zeros(dk_ref.shape, jnp.float32)
    dv_ref[...] = jnp.zeros(dv_ref.shape, jnp.float32)

    def copies(u, slot):
        return [pltpu.make_async_copy(dk_hbm.at[first + u], dk_buf.at[slot], sems.at[0, slot]),
                pltpu.make_async_copy(dv_hbm.at[first + u], dv_buf.at[slot], sems.at[1, slot])]

    def add(u, slot):
        dk_ref[...] += dk_buf[slot]
        dv_ref[...] += dv_buf[slot]

    _pipelined(list_ref[0, 1], copies, add)


# ------------------------------------------------------------------------------------------ layouts


class _Layout(Tiling):
    """The static sizes of one call (see the module docstring): nsa._plan.Tiling's for tiles of config.tokens
    tokens, and BR, BK, Dkp, Dvp, whether the forward gathers its blocks or copies them from the cache as it is
    (direct), and the pieces a direct copy of a block takes (a paged cache's page_size S: 1 where S is a multiple
    of block_size, block_size / S where S divides it)."""

    def __init__(self, q, k, v, block_indices, block_size, cu_seqlens, kv_lens, cfg, page_size=None):
        super().__init__(q, k, block_indices, block_size, cu_seqlens, cfg.tokens)
        self.br = _copied_rows(block_size, k.dtype)  # the rows copied per block, block_size rounded up to the sublanes
        self.bk = round_up(block_size, lanes())  # the rows of a key buffer, block_size rounded up to 128
        self.dkp, self.dvp = lane_padded(q.shape[3]), lane_padded(v.shape[3])
        # the forward of a KV cache step whose tiles list fewer rows than the cache holds (a decode step) reads only
        # those: from the cache as it is (direct: block_size rows of every head a copy, whole tiles of the cache's
        # minor dims (H, D), since Mosaic copies no single head from a tiled dim: seen on a TPU v5e) where every
        # block lies within TK and the heads need no padding, else gathered in XLA first (`_gathered_rows`). A
        # paged cache's forward copies from its pool's pages, always (`paged_forward`, where `reads_pages`)
        few = kv_lens is not None and 0 < self.nt * self.union * self.br < self.TK
        self.pieces = 1 if page_size is None else max(1, block_size // page_size)
        self.direct = _unpadded_heads(q, v) and (few and self.TK % block_size == 0 if page_size is None
                                                 else _whole_pieces(page_size, block_size))
        self.gathered = few and not self.direct
        # packed sequences: k and v laid out block by block (`_block_starts`, `_key_rows`), each block at a row
        # that is a multiple of BR, since a packed sequence starts anywhere and Mosaic copies only from rows of
        # a tiled HBM array it can prove aligned to its 8-row tile (seen on a TPU v5e)
        self.blocked = cu_seqlens is not None and kv_lens is None
        self.cu = cu_seqlens
        self.starts, self.before = _block_starts(cu_seqlens, self, block_size) if self.blocked else (None, None)
        # what every source row of a block copy is a multiple of, in `_key_rows` (block starts j * block_size,
        # or multiples of BR when blocked) and in what the forward reads (`_gathered_rows`: multiples of BR)
        self.key_align = math.gcd(self.br if self.blocked else block_size, 8)
        self.align = math.gcd(self.br, 8) if self.gathered else self.key_align


def _query_tiles(x, lay, dp):
    """[B, T, HQ, D] -> [B, H, NT, G, TB, dp], zero-padded."""
    x = padded(padded(x, 3, dp), 1, lay.nt * lay.tb)
    x = x.reshape(lay.B, lay.nt, lay.tb, lay.H, lay.G, dp)
    return jnp.transpose(x, (0, 3, 1, 4, 2, 5))


def _from_query_tiles(x, lay, d):
    """[B, H, NT, G, TB, Dp] -> [B, T, HQ, d]."""
    x = jnp.transpose(x, (0, 2, 4, 1, 3, 5)).reshape(lay.B, lay.nt * lay.tb, lay.H * lay.G, x.shape[5])
    return x[:, :lay.T, :, :d]


def _row_tiles(x, lay, fill):
    """[B, T, HQ] float32 -> [B, H, NT, G, TB, 1], padded with `fill`."""
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, lay.nt * lay.tb - lay.T), (0, 0)], constant_values=fill)
    return _query_tiles(x[..., None], lay, 1)


def _key_rows(x, lay, dp):
    """[B, TK, H, D] -> [B, H, (NR + 1) * BR, dp], zero-padded: a copy of BR rows from any block start x < TK
    stays in bounds, and rows `_zero_row` .. + BR - 1 are zeros. Packed sequences (lay.blocked): block n's BR rows
    from its first key row lay.starts[n] (rows past TK clamped to it: `_block` zeroes them), so that every block
    starts at a multiple of BR, then BR rows of zeros."""
    if lay.blocked:
        rows = jnp.minimum(lay.starts[:, None] + jnp.arange(lay.br, dtype=jnp.int32), lay.TK - 1)  # [NR, BR]
        blocks = jnp.transpose(x[:, rows], (0, 3, 1, 2, 4))  # [B, H, NR, BR, D]
        x = padded(blocks, 4, dp).reshape(lay.B, lay.H, lay.num_rows * lay.br, dp)
        return padded(x, 2, _key_rows_count(lay))
    return jnp.transpose(padded(padded(x, 3, dp), 1, _key_rows_count(lay)), (0, 2, 1, 3))


def _zero_row(lay):
    """The first of the BR rows of zeros of `_key_rows`, past every block's: NR * BR."""
    return lay.num_rows * lay.br


def _block_starts(cu_seqlens, lay, block_size):
    """Packed sequences, block by block: (int32 [NR]: the first key row of block n, block j of sequence s being
    n = before[s] + j at cu_seqlens[s] + j * block_size, 0 past the last real block; before, int32 [N]: the
    blocks of the sequences before each)."""
    cu = cu_seqlens.astype(jnp.int32)
    blocks = (cu[1:] - cu[:-1] + block_size - 1) // block_size  # [N]
    ends = jnp.cumsum(blocks)
    before = ends - blocks
    n = jnp.arange(lay.num_rows, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, n, side="right"), blocks.shape[0] - 1)
    real = n < ends[-1]
    return jnp.where(real, cu[seq] + (n - before[seq]) * block_size, 0), before


def _copy_rows(names, lay, block_size):
    """int32 [...]: the row of `_key_rows` that block names (first key rows) are copied from: the names
    themselves, or with packed sequences the block's place times BR (a name outside every sequence, e.g.
    nsa._plan.PAST, gives a row that is never copied)."""
    if not lay.blocked:
        return names
    cu = lay.cu.astype(jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, names, side="right") - 1, 0, cu.shape[0] - 2)
    return jnp.clip(lay.before[seq] + (names - cu[seq]) // block_size, 0, lay.num_rows - 1) * lay.br


def _gathered_rows(x, union, lay, dp):
    """[B, TK, H, D] -> [B, H, NT * U * BR, dp]: the BR rows from each union block's first row, tile after
    tile (rows past TK clamped to it: `_block` zeroes them), zero-padded to dp. With a KV cache the forward
    gathers these rows, O(T * S * block_size) per KV head, and never copies or transposes the cache."""
    rows = jnp.where(union == PAST, 0, union)[..., None] + jnp.arange(lay.br, dtype=jnp.int32)
    b = jnp.arange(lay.B)[:, None, None, None, None]
    h = jnp.arange(lay.H)[None, :, None, None, None]
    blocks = x[b, jnp.minimum(rows, lay.TK - 1), h]  # [B, H, NT, U, BR, D]
    return padded(blocks, 5, dp).reshape(lay.B, lay.H, lay.nt * lay.union * lay.br, dp)


def _source_rows(union, lay, gathered, block_size):
    """int32 [B, H, NT, U]: the row of k_hbm each union block is copied from: its row in `_key_rows`
    (`_copy_rows`), or its place in `_gathered_rows`."""
    if not gathered:
        return _copy_rows(union, lay, block_size)
    place = jnp.arange(lay.nt, dtype=jnp.int32)[:, None] * lay.union + jnp.arange(lay.union, dtype=jnp.int32)
    return jnp.broadcast_to(place * lay.br, union.shape)


def _sources(union, lay, block_size, gathered, pages=None):
    """int32 [B, H, NT, U, 2 * pieces]: where the copies of each union block read, a (batch row or page, row) pair
    per piece: (b, `_source_rows`) for k_hbm [B, H, rows, Dp] or a cache as it is [B, TK, H, D]; with a paged
    cache, pages = (its page_table int [B, MP], the pool's P pages), the (page, row in it) of each piece's first row
    x + j * block_size / pieces. A piece whose entry is no page of the pool lies past its sequence (whose readable
    length ends at its first such entry: `nsa._kvcache.readable_lens`) and is never seen: it is copied from the
    page of its block's first piece (the sequence's own), so no copy reads through that entry into another
    sequence's page."""
    if pages is None:
        rows = _source_rows(union, lay, gathered, block_size)
        at = jnp.broadcast_to(jnp.arange(lay.B, dtype=jnp.int32)[:, None, None, None], rows.shape)
        return jnp.stack([at, rows], -1)
    page_table, pool = pages
    S = lay.TK // page_table.shape[1]
    rows = (jnp.where(union == PAST, 0, union)[..., None]
            + jnp.arange(lay.pieces, dtype=jnp.int32) * (block_size // lay.pieces))  # [B, H, NT, U, pieces]
    index = jnp.clip(rows // S, 0, page_table.shape[1] - 1).reshape(lay.B, -1)
    at = jnp.take_along_axis(page_table.astype(jnp.int32), index, axis=1).reshape(rows.shape)
    at = jnp.where((at >= 0) & (at < pool), at, at[..., :1])
    return jnp.stack([jnp.clip(at, 0, pool - 1), rows % S], -1).reshape(rows.shape[:4] + (2 * lay.pieces,))


def _smem_rows(*columns):
    """Per-step SMEM tables: [..., 1, W] int32 from leading columns [...] and trailing tables [..., n]."""
    cols = [c[..., None] if c.ndim == columns[0].ndim else c for c in columns]
    return jnp.concatenate([c.astype(jnp.int32) for c in cols], axis=-1)[..., None, :]


def _tiles(block_indices, block_counts, cu_seqlens, kv_lens, lay, block_size, gathered, pages=None):
    """What the forward and the backward both build (nsa._plan): (names [B, H, NT, TB, S]; the tiles' SMEM rows
    [B, H, NT, 1, 2 + 2U + 2 * pieces * U]: count, t0, union, last, the `_sources` (pages: a paged cache's);
    union and last [B, H, NT, U]; the `row_offsets`)."""
    offsets = row_offsets(kv_lens, lay.T)
    names = tile_names(block_names(block_indices, block_counts, cu_seqlens, kv_lens, block_size=block_size), lay.tb)
    union, last, count = tile_unions(names, offsets, lay.union)
    sources = _sources(union, lay, block_size, gathered, pages)
    blocks = _smem_rows(count, tile_starts(offsets, (lay.B, lay.H, lay.nt), lay.tb), union, last,
                        sources.reshape(union.shape[:3] + (-1,)))
    return names, blocks, union, last, offsets


def _block_buffers(lay, k, v, copies, direct=False):
    """Double buffers of one block's keys and values ([2, BK, H, D], every head's, when `direct`), and the DMA
    semaphores of `copies` copy streams. (A direct decode step's forward ran no faster with 3 blocks in flight
    than with 1 on a TPU v5e: 1291 against 1295 us a B = 8, 16k step.)"""
    heads = (lay.H,) if direct else ()
    return [pltpu.VMEM((2, lay.bk) + heads + (lay.dkp,), k.dtype),
            pltpu.VMEM((2, lay.bk) + heads + (lay.dvp,), v.dtype), pltpu.SemaphoreType.DMA((copies, 2))]


def _query_grid(kernel, lay, blocks, tiled, k_rows, v_rows, outputs, scratch, *, q, scale, block_size,
                interpret, name, align):
    """pallas_call of the forward or the dq kernel on the grid (B, H, NT): the tile's SMEM blocks row,
    then the tiled inputs [B, H, NT, ...] (one block each), then k and v in HBM (their copies' source rows
    multiples of `align`)."""
    def tile_spec(shape):
        return pl.BlockSpec((None, None, None) + shape[3:], lambda b, h, i: (b, h, i) + (0,) * (len(shape) - 3))

    compiler, dots = params(q, interpret, ("parallel", "parallel", "parallel"))
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    return pl.pallas_call(
        functools.partial(kernel, scale=float(scale), block_size=block_size, align=align, pieces=lay.pieces,
                          **dots),
        grid=(lay.B, lay.H, lay.nt),
        in_specs=[pl.BlockSpec((None, None, None) + blocks.shape[3:], lambda b, h, i: (b, h, i, 0, 0),
                               memory_space=pltpu.SMEM)]
        + [tile_spec(x.shape) for x in tiled] + [any_spec, any_spec],
        out_specs=[tile_spec(o.shape) for o in outputs],
        out_shape=outputs, scratch_shapes=scratch, name=name, **compiler,
    )(blocks, *tiled, k_rows, v_rows)


def vmem_bytes(G, dk, dv, itemsize, block_size, num_slots, config, heads=None):
    """The VMEM one grid step holds, the largest over the four kernels: BlockSpec blocks double-buffered
    (1-wide and int32 blocks padded to the lanes), the DMA buffers and the float32 scratch; heads: the H of
    a direct forward (a decode step reading the cache as it is), whose block buffers hold every head's rows
    (H padded to the sublane tile of the cache's dtype)."""
    tb, lane = config.tokens, lanes()
    R = G * tb
    sub = facts("tpu").sublanes * 4 // itemsize  # the sublane tile's rows
    br, bk = round_up(block_size, sub), round_up(block_size, lane)
    dkp, dvp = lane_padded(dk), lane_padded(dv)
    slots = round_up(num_slots, lane)
    tile = (R * dkp + R * dvp) * itemsize + 2 * R * lane * 4 + tb * slots * 4  # q, do, lse, delta, names
    block = bk * (dkp + dvp) * itemsize
    blocks = 2 * block * (1 if heads is None else round_up(heads, sub))
    forward = 2 * (R * dkp * itemsize + tb * slots * 4 + R * dvp * itemsize + R * lane * 4) + blocks \
        + (2 * R * lane + R * dvp) * 4
    dq = 2 * (tile + R * dkp * itemsize) + 2 * block + R * dkp * 4
    dkdv = 2 * tile + block + 2 * br * (dkp + dvp) * 4
    reduce = 4 * br * (dkp + dvp) * 4
    return max(forward, dq, dkdv, reduce)


def _config(config, q, k, v, block_indices, block_size, forward=False):
    """config, or the default_config of q [B, T, HQ, Dk] against k [B, TK, H, Dk], v [B, TK, H, Dv] (for the
    forward alone where `forward`)."""
    if config is not None:
        return config
    shapes = Shapes.of(q, k, v, block_size=block_size, block_counts=block_indices.shape[3])
    return default_config(shapes, q.dtype, facts("tpu"), forward=forward)


# ------------------------------------------------------------------------------------------ forward


def forward(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens=None, *, block_size, scale, interpret=False,
            config=None):
    """o [B, T, HQ, Dv] (q's dtype) and the residuals (q, k, v, block_indices, block_counts, cu_seqlens,
    kv_lens, o, lse [B, T, HQ] float32).

    q [B, T, HQ, Dk], k [B, TK, H, Dk], v [B, TK, H, Dv]; block_indices int [B, T, H, S]; block_counts int
    [B, T, H] (or a scalar); cu_seqlens None or int32 [N + 1] (B = 1); kv_lens None (TK = T) or int32 [B]
    (a KV cache: the queries are the last T tokens of sequences of kv_lens[b] tokens). interpret: False
    (Mosaic) or a pltpu.InterpretParams; config: a Config or None (`default_config`). A symbolic batch runs
    once per sequence (`per_sequence`): the kernels' DMAs read k and v whole, from HBM.
    """
    o, lse = per_sequence(_attention)(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens,
                                      block_size=block_size, scale=scale, interpret=interpret, config=config)
    return o, (q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse)


def _unpadded_heads(q, v):
    """Whether q's and v's heads need no padding to the lanes (Dk, Dv multiples of 128): a copy then takes them whole."""
    return (lane_padded(q.shape[3]), lane_padded(v.shape[3])) == (q.shape[3], v.shape[3])


def _whole_pieces(page_size, block_size):
    """Whether a paged cache's blocks copy in whole pieces: pages of whole blocks, or blocks of whole pages."""
    return page_size % block_size == 0 or block_size % page_size == 0


def reads_pages(q, k, v, block_size):
    """Whether `paged_forward` runs q [B, T, HQ, Dk] against a paged cache's pools k [P, S, H, Dk], v [P, S, H, Dv]:
    `_unpadded_heads` and `_whole_pieces` (S a multiple of block_size, or a divisor of it)."""
    return _unpadded_heads(q, v) and _whole_pieces(k.shape[1], block_size)


def paged_forward(q, k, v, block_indices, block_counts, kv_lens, page_table, *, block_size, scale, interpret=False,
                  config=None):
    """o [B, T, HQ, Dv] (q's dtype): `forward` over a paged cache, without residuals (a step over pages takes its
    gradient through the pages gathered in XLA: nsa._dispatch.paged_selected). k [P, S, H, Dk] and v [P, S, H, Dv]
    are its pools of pages, page_table int [B, MP] each sequence's pages in order (its key rows are those of
    `nsa._kvcache.gathered(page_table, k, v)`, MP * S of them), kv_lens int32 [B] its lengths. Each block's rows of
    every head are copied from its page (or pages) in HBM straight into the kernel's buffers (`_sources`): nothing
    of the pools is gathered. Where not `reads_pages`, a ValueError."""
    if not reads_pages(q, k, v, block_size):
        raise ValueError(f"paged_forward needs heads of multiples of 128 (Dk = {q.shape[3]}, Dv = {v.shape[3]}) and "
                         f"a page size (k.shape[1] = {k.shape[1]}) that is a multiple or a divisor of block_size = "
                         f"{block_size}")
    o, _ = per_sequence(_attention)(q, k, v, block_indices, block_counts, None, kv_lens, page_table,
                                    block_size=block_size, scale=scale, interpret=interpret, config=config)
    return o


def _attention(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, page_table=None, *, block_size, scale,
               interpret, config):
    """`forward`'s o and lse; with a page_table (`paged_forward`) k and v are pools of pages."""
    seen_k, seen_v = as_sequences(k, page_table), as_sequences(v, page_table)  # [B, TK, H, D] (shapes, if paged)
    check_selected(q, seen_k, block_indices, block_size)
    if page_table is None and resident(q, k, v, block_indices, block_size, cu_seqlens, kv_lens, config, False):
        return _resident_attention(q, k, v, block_indices, block_counts, cu_seqlens, block_size=block_size,
                                   scale=scale, interpret=interpret)
    cfg = _config(config, q, seen_k, seen_v, block_indices, block_size, forward=True)
    page_size, pages = (None, None) if page_table is None else (k.shape[1], (page_table, k.shape[0]))
    lay = _Layout(q, seen_k, seen_v, block_indices, block_size, cu_seqlens, kv_lens, cfg, page_size)
    names, blocks, union, _, _ = _tiles(block_indices, block_counts, cu_seqlens, kv_lens, lay, block_size,
                                        lay.gathered, pages)
    if lay.direct:
        rows = lambda x, lay, dp: x
    else:
        rows = functools.partial(_gathered_rows, union=union) if lay.gathered else _key_rows
    R = lay.G * lay.tb
    tile_shape = (lay.B, lay.H, lay.nt, R)
    o, lse = _query_grid(
        _fwd_kernel, lay, blocks, [_query_tiles(q, lay, lay.dkp).reshape(tile_shape + (lay.dkp,)), names],
        rows(k, lay=lay, dp=lay.dkp), rows(v, lay=lay, dp=lay.dvp),
        [out_struct(tile_shape + (lay.dvp,), q.dtype, q), out_struct(tile_shape + (1,), jnp.float32, q)],
        _block_buffers(lay, k, v, 2, lay.direct) + [pltpu.VMEM((R, lanes()), jnp.float32)] * 2
        + [pltpu.VMEM((R, lay.dvp), jnp.float32)],
        q=q, scale=scale, block_size=block_size, interpret=interpret, name="selected_forward", align=lay.align)
    tiles = lambda x: x.reshape(lay.B, lay.H, lay.nt, lay.G, lay.tb, x.shape[-1])
    return _from_query_tiles(tiles(o), lay, v.shape[3]), _from_query_tiles(tiles(lse), lay, 1)[..., 0]


# ------------------------------------------------------------------------------------------ backward


def _dkdv_partials(lay, seg_table, k_rows, v_rows, tiled, *, q, k, v, scale, block_size, interpret):
    """The dk/dv kernel on the grid (NSEG,): float32 partials [NSEG, BR, Dkp] and [NSEG, BR, Dvp]."""
    nseg = seg_table.shape[0]
    compiler, dots = params(q, interpret, ("parallel",))
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    tile_buffer = lambda x: pltpu.VMEM((2,) + x.shape[3:], x.dtype)
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=float(scale), block_size=block_size, align=lay.key_align, **dots),
        grid=(nseg,),
        in_specs=[pl.BlockSpec((None,) + seg_table.shape[1:], lambda s: (s, 0, 0), memory_space=pltpu.SMEM)]
        + [any_spec] * (2 + len(tiled)),
        out_specs=[pl.BlockSpec((None, lay.br, lay.dkp), lambda s: (s, 0, 0)),
                   pl.BlockSpec((None, lay.br, lay.dvp), lambda s: (s, 0, 0))],
        out_shape=[out_struct((nseg, lay.br, lay.dkp), jnp.float32, q),
                   out_struct((nseg, lay.br, lay.dvp), jnp.float32, q)],
        scratch_shapes=[pltpu.VMEM((1, lay.bk, lay.dkp), k.dtype), pltpu.VMEM((1, lay.bk, lay.dvp), v.dtype)]
        + [tile_buffer(x) for x in tiled] + [pltpu.SemaphoreType.DMA((2 + len(tiled), 2))], name="selected_dkdv",
        **compiler,
    )(seg_table, k_rows, v_rows, *tiled)


def _reduced(lay, lists, dk_part, dv_part, *, interpret):
    """The reduce kernel on the grid (NL,): each list's partials summed in segment order, [NL, BR, Dp]."""
    num_lists = lists.shape[0]
    compiler, _ = params(dk_part, interpret, ("parallel",))
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    return pl.pallas_call(
        _reduce_kernel, grid=(num_lists,),
        in_specs=[pl.BlockSpec((None, 1, 2), lambda l: (l, 0, 0), memory_space=pltpu.SMEM), any_spec, any_spec],
        out_specs=[pl.BlockSpec((None, lay.br, lay.dkp), lambda l: (l, 0, 0)),
                   pl.BlockSpec((None, lay.br, lay.dvp), lambda l: (l, 0, 0))],
        out_shape=[out_struct((num_lists, lay.br, lay.dkp), jnp.float32, dk_part),
                   out_struct((num_lists, lay.br, lay.dvp), jnp.float32, dk_part)],
        scratch_shapes=[pltpu.VMEM((2, lay.br, lay.dkp), jnp.float32), pltpu.VMEM((2, lay.br, lay.dvp), jnp.float32),
                        pltpu.SemaphoreType.DMA((2, 2))], name="selected_dkdv_reduce", **compiler,
    )(lists, dk_part, dv_part)


@per_sequence
def backward(residuals, do, *, block_size, scale, interpret=False, config=None):
    """Gradients (dq, dk, dv, None, None, None, None) in q's, k's and v's dtypes, from `forward`'s residuals
    and do [B, T, HQ, Dv]; interpret and config as for `forward` (and a symbolic batch once per sequence)."""
    q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse = residuals
    passes = resident(q, k, v, block_indices, block_size, cu_seqlens, kv_lens, config, True)
    if passes:
        dq, dk, dv = _resident_backward(q, k, v, block_indices, block_counts, cu_seqlens, o, lse, do, passes=passes,
                                        block_size=block_size, scale=scale, interpret=interpret)
        return dq, dk, dv, None, None, None, None
    cfg = _config(config, q, k, v, block_indices, block_size)
    lay = _Layout(q, k, v, block_indices, block_size, cu_seqlens, kv_lens, cfg)
    names, blocks, union, last, offsets = _tiles(block_indices, block_counts, cu_seqlens, kv_lens, lay,
                                                 block_size, False)
    delta = kernel_delta(o, do, q.dtype)
    do = do.astype(q.dtype)
    tiled = [_query_tiles(q, lay, lay.dkp), _query_tiles(do, lay, lay.dvp), _row_tiles(lse, lay, -jnp.inf),
             _row_tiles(delta, lay, 0.0), names]
    k_rows, v_rows = _key_rows(k, lay, lay.dkp), _key_rows(v, lay, lay.dvp)
    common = dict(q=q, scale=scale, block_size=block_size, interpret=interpret)

    [dq] = _query_grid(
        _dq_kernel, lay, blocks, [tiled[0], names] + tiled[1:4], k_rows, v_rows,
        [out_struct((lay.B, lay.H, lay.nt, lay.G, lay.tb, lay.dkp), q.dtype, q)],
        _block_buffers(lay, k, v, 2) + [pltpu.VMEM((lay.G * lay.tb, lay.dkp), jnp.float32)], name="selected_dq",
        align=lay.key_align, **common)

    lists_offsets, tile, name, last = tile_lists(union, last, cu_seqlens, num_keys=lay.TK, block_size=block_size)
    seg_offsets, seg_list, lo, hi = segments(lists_offsets, tile.shape[0], cfg.segment)
    entry = jnp.minimum(lo[:, None] + jnp.arange(cfg.segment), tile.shape[0] - 1)
    lists_per_b = lay.H * lay.num_rows
    seg_b = seg_list // lists_per_b
    seg_table = _smem_rows(seg_b, seg_list % lists_per_b // lay.num_rows, name[lo], hi - lo,
                           jnp.broadcast_to(offsets, (lay.B,))[seg_b], _copy_rows(name[lo], lay, block_size),
                           tile[entry], last[entry])
    dk_part, dv_part = _dkdv_partials(lay, seg_table, k_rows, v_rows, tiled, k=k, v=v, **common)
    lists = _smem_rows(seg_offsets[:-1], seg_offsets[1:] - seg_offsets[:-1])
    dk_sum, dv_sum = _reduced(lay, lists, dk_part, dv_part, interpret=interpret)
    dq = _from_query_tiles(dq, lay, q.shape[3])
    dk = per_key_row(dk_sum, k.shape, cu_seqlens, block_size=block_size) * scale
    dv = per_key_row(dv_sum, v.shape, cu_seqlens, block_size=block_size)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


# ------------------------------------------------------------------------------------------ resident (training)
#
# The keys and values of one (batch row, KV head) resident in VMEM, token by token: where `resident` holds (no KV
# cache; `resident_plan` finds passes whose VMEM fits RESIDENT_SHARE of the device's), `_attention` and `backward`
# run these kernels instead of the union ones above. On random selections a tile's union holds nearly every block,
# and the union kernels compute dense attention under a mask (2.6 useful TFLOP/s at 8k on a TPU v5e, 2026-12-06);
# here each token attends to its own S blocks and nothing else: its G query heads are the M = G rows of two matmuls
# against the SP * BR rows its slots name, gathered by dynamic slices of the resident rows (no DMA per block), so
# the work is the useful work whatever the selections share.
#
# Layouts (XLA): q [B, Tp, H, G, Dkp], do, o [.., Dvp], lse, delta [B, Tp, H, G, 1] float32 (the backward's where
# G is a multiple of 8: lane rows [B, H, 1, Tp * G], `_lane_rows`, lane-dense) (`_token_rows`: Tp = T
# padded to TB = RESIDENT_TOKENS; nsa's [B, T, HQ, D] itself where T = Tp and D = Dp, no transpose: a (b, h)'s (TB,
# G, Dp) block, token j's G rows at [j], is TB runs of G * Dp contiguous elements); k, v `_key_rows` [B, H, KR, Dp],
# block n's rows at n * BR (BR = block_size when it is a multiple of the sublane tile; the blocks of packed
# sequences at multiples of BR), then BR rows of zeros; the table [B, H, NT, 1, 2 * TB * SP + 1] int32 in SMEM, a
# row per step (`_resident_table`): each token's slots, those it sees in part first: each one's source row in k
# (`_copy_rows`; the zero rows when it sees none of it), then the last row c of its block the token sees
# (min(block_size - 1, the token's key row - the block's first), -1 when none), then whether every token sees at most
# one slot in part (its own current block: then its gather zeroes that slot alone, `_token_path`), followed by its
# union tiles' entries (`_union_table`, below): `_step_table`, one table that the forward and every backward pass
# read, so that all take the same tiles by the union path. SP: S padded so that SP * BR logits are whole lanes (the
# padded slots skipped).
#
# Single buffers. k and v stay in HBM (memory_space HBM) and the kernel copies the (b, h)'s rows into VMEM scratch
# [KR, Dp] itself at the row's first grid step; the backward's float32 dk and dv sums are VMEM scratch too, zeroed
# there, and copied into their HBM outputs [B, H, KR, Dp] at the row's last step. The grid (B, H, NT) walks a row's
# NT tiles in order on one core (NT "arbitrary"; B and H "parallel", split between a megacore's cores): one buffer
# each, where BlockSpecs whole per (b, h) would double-buffer them (the copy in is not overlapped with compute: at
# 64k tokens of the standard shape 32 MiB, some 40 us of a v5e's HBM, against a row's ~100 ms of work).
#
# Passes (`resident_plan`, from `resident_bytes`): the backward is one pass (dq, dk, dv: k, v and float32 dk, dv
# resident), or, where that does not fit, two over the whole grid: (dq, dk), holding k, v and dk, then (dv),
# holding k and dv only (p = exp(q k^T * scale - lse) needs no v). The second recomputes q k^T and p (7 matmuls a
# token instead of 5); each sum is added to in the same order as in one pass (the same union tiles taken), so the
# gradients are bitwise those of one pass. At the standard shape (B = 1, HQ = 64, H = 4, D = 128, bf16, block_size
# 64, S = 16) within 96 MiB (3/4 of a v5e's 128): one pass to 32k tokens (k, v 16 MiB and dk, dv 32 MiB at 32k), two
# at 64k (32 + 32 MiB, then 16 + 32), none at 128k (the union kernels run). The forward holds k and v: 32 MiB at
# 64k, 64 MiB at 128k. The union tiles' buffers add 1 MiB to each pass (k_union, v_union [UC * BR, Dp]; 0.5 to dv's).

RESIDENT_TOKENS = 16  # query tokens per grid step: a step's fixed cost shared by 16 tokens' work
RESIDENT_UNROLL = 4  # tokens a step of the token loop (`_token_loop`), each with its own copy of the buffers
RESIDENT_SHARE = 0.75  # the most of a TensorCore's VMEM the resident kernels plan to hold
RESIDENT_MARGIN = 8 * 2 ** 20  # scoped VMEM asked beyond `resident_bytes`: Mosaic's temporaries ([G, SP * BR] logits;
# a union tile's [UT * G, UC * BR] float32 values, 1 MiB each at the standard shape: the backward's s, p, dp, ds, p^T,
# ds^T and its [UC * BR, Dp] dk, dv, some 6 MiB live at once if Mosaic frees each after its last use; not measured)
FORWARD = ("o", "lse")  # the outputs of the resident forward, its one pass
BACKWARD_PLANS = ((("dq", "dk", "dv"),), (("dq", "dk"), ("dv",)))  # the backward's passes, fewest first


def _padded_slots(S, br):
    """SP: the fewest slots >= S whose SP * BR columns are whole lanes."""
    return round_up(S, lanes() // math.gcd(lanes(), br))


def _key_rows_count(lay):
    """The rows of `_key_rows`: (NR + 1) * BR, the last BR zeros (`_zero_row`)."""
    return (lay.num_rows + 1) * lay.br


def _keys_read(outputs):
    """The key rows a pass computing `outputs` reads: k, and v for the forward (p v) and dq, dk (ds = p (do v^T -
    delta)); dv alone (p^T do) reads k only."""
    return ("k",) if outputs == ("dv",) else ("k", "v")


def _step_tiles(lay, dtype, outputs):
    """(d, dtype) of the (TB, G, d) tiles a step of a pass computing `outputs` moves through BlockSpecs: q and o (or
    do), and dq where computed."""
    return [(lay.dkp, dtype), (lay.dvp, dtype)] + ([(lay.dkp, dtype)] if "dq" in outputs else [])


def _resident_scratch_names(outputs, union=False, lane_rows=False):
    """The VMEM scratch of a pass computing `outputs` (FORWARD, or some of dq, dk, dv), in the kernel's order: the
    (b, h)'s resident rows k (and v where read), a token's gathered blocks k_buf (and v_buf), a union tile's gathered
    blocks k_union (and v_union) where `union` (`_union_tokens` > 1), the backward's float32 sums dk_sum, dv_sum of
    those it computes, and where its lse (and the backward's delta) are `lane_rows` (`_stats_in_lanes`), their
    (TB, G, 1) tiles lse_rows (and delta_rows)."""
    keys = _keys_read(outputs)
    unions = tuple(x + "_union" for x in keys) if union else ()
    stats = (("lse_rows",) if outputs == FORWARD else ("lse_rows", "delta_rows")) if lane_rows else ()
    return (keys + tuple(x + "_buf" for x in keys) + unions + tuple(g + "_sum" for g in ("dk", "dv") if g in outputs)
            + stats)


def _resident_scratch(lay, dtype, outputs):
    """{name: (shape, dtype)} of `_resident_scratch_names`: k, v [KR, Dp] in `dtype`, k_buf, v_buf
    [UNROLL * SP * BR, Dp] (a copy per token of a `_token_loop` step),
    k_union, v_union [UC * BR, Dp] (`_union_slots`), dk_sum, dv_sum [KR, Dp] float32, lse_rows, delta_rows (TB, G,
    1) float32."""
    rows = {"buf": RESIDENT_UNROLL * _padded_slots(lay.S, lay.br) * lay.br, "union": _union_slots(lay) * lay.br}
    dp = {"k": lay.dkp, "v": lay.dvp, "dk": lay.dkp, "dv": lay.dvp}

    def buffer(name):
        head, _, kind = name.partition("_")
        if kind == "rows":
            return (lay.tb, lay.G, 1), jnp.float32
        return (rows.get(kind, _key_rows_count(lay)), dp[head]), jnp.float32 if kind == "sum" else dtype

    names = _resident_scratch_names(outputs, _union_tokens(lay) > 1, _stats_in_lanes(lay))
    return {name: buffer(name) for name in names}


def _stats_in_lanes(lay):
    """Whether the resident backward takes lse and delta as lane rows (`_lane_rows`): a step's TB * G values whole
    lanes, and each token's G rows of their column whole float32 sublane tiles (G a multiple of 8)."""
    return (lay.tb * lay.G) % lanes() == 0 and lay.G % sublanes(jnp.float32) == 0


def _lane_row_bytes(lay, count):
    """The VMEM of `count` (1, TB * G) float32 lane-row blocks (`_lane_rows`), each padded to a sublane tile."""
    return count * sublanes(jnp.float32) * lay.tb * lay.G * 4


def _tile_bytes(lay, d, dtype):
    """The VMEM of one (TB, G, d) block of a tile: G padded to the sublane tile, d to the lanes."""
    return lay.tb * round_up(lay.G, sublanes(dtype)) * round_up(d, lanes()) * jnp.dtype(dtype).itemsize


def resident_bytes(lay, dtype, outputs):
    """The VMEM a grid step of a resident pass computing `outputs` (FORWARD, or some of dq, dk, dv) holds: its
    `_resident_scratch` (the union tiles' buffers included), one buffer each, and its tiles through BlockSpecs,
    double-buffered (forward: q in, o and lse out; backward: q, do, lse, delta in, dq out if computed). Mosaic's
    temporaries are RESIDENT_MARGIN's."""
    scratch = sum(math.prod(shape[:-2]) * round_up(shape[-2], sublanes(dt)) * round_up(shape[-1], lanes())
                  * jnp.dtype(dt).itemsize for shape, dt in _resident_scratch(lay, dtype, outputs).values())
    stats = 1 if outputs == FORWARD else 2  # lse (and delta)
    tiles = _step_tiles(lay, dtype, outputs)
    if _stats_in_lanes(lay):
        lane_rows = _lane_row_bytes(lay, stats)
    else:
        lane_rows, tiles = 0, tiles + [(1, jnp.float32)] * stats
    return scratch + 2 * (sum(_tile_bytes(lay, d, dt) for d, dt in tiles) + lane_rows)


def resident_plan(lay, dtype, backward, vmem, bytes_of=None):
    """The passes a resident kernel runs within a TensorCore of `vmem` bytes of VMEM: (FORWARD,), or the first of
    BACKWARD_PLANS whose every pass's bytes (`bytes_of(lay, dtype, outputs)`, default `resident_bytes`) +
    RESIDENT_MARGIN is within RESIDENT_SHARE of vmem; None when none fits."""
    bytes_of = bytes_of or resident_bytes
    for passes in BACKWARD_PLANS if backward else ((FORWARD,),):
        if all(bytes_of(lay, dtype, p) + RESIDENT_MARGIN <= RESIDENT_SHARE * vmem for p in passes):
            return passes
    return None


def resident(q, k, v, block_indices, block_size, cu_seqlens, kv_lens, config, backward):
    """The passes (`resident_plan`, on the device's VMEM: off a TPU, nsa._device's smallest) of the resident forward
    (backward False) or backward that `_attention` or `backward` runs on q [B, T, HQ, Dk], k [B, TK, H, Dk], v [B,
    TK, H, Dv], block_indices [B, T, H, S]; None (the union kernels run) with a Config given (a Config sets the union
    kernels' tiles), with a KV cache, with blocks that do not start at multiples of the sublane tile (block_size
    not a multiple of it, but for packed sequences, laid out block by block), or where no plan fits. At the
    standard shape on a TPU v5e the backward is one pass to 32k tokens, two at 64k."""
    if config is not None or kv_lens is not None or (cu_seqlens is None and block_size % sublanes(k.dtype)):
        return None
    lay = _resident_layout(q, k, v, block_indices, block_size, cu_seqlens)
    return resident_plan(lay, k.dtype, backward, facts("tpu").vmem)


def _resident_layout(q, k, v, block_indices, block_size, cu_seqlens):
    """`_Layout` for tiles of RESIDENT_TOKENS tokens, without a KV cache."""
    return _Layout(q, k, v, block_indices, block_size, cu_seqlens, None, Config(RESIDENT_TOKENS, 1))


def _token_rows(x, lay, dp, fill=0.0):
    """[B, T, HQ, D] -> [B, Tp, H, G, dp], padded with zeros (D) and `fill` (T): no transpose (a reshape, free where
    D = dp and T = Tp), the kernels' BlockSpecs take each (b, h)'s (TB, G, dp) tiles from it."""
    x = jnp.pad(padded(x, 3, dp), [(0, 0), (0, lay.nt * lay.tb - lay.T), (0, 0), (0, 0)], constant_values=fill)
    return x.reshape(lay.B, lay.nt * lay.tb, lay.H, lay.G, dp)


def _lane_rows(x, lay, fill=0.0):
    """A row statistic [B, T, HQ] float32 -> [B, H, 1, Tp * G], token-major as `_token_rows` (token t's head g at t *
    G + g), lane-dense: [B, Tp, H, G, 1] would take 128 lanes a value under the TPU's (8, 128) tiles (2 GiB where this
    takes 16 MiB, at 64k tokens of the standard shape). A step's (1, TB * G) block is a row a kernel turns into its
    [TB * G, 1] column (`_lane_column`); TB * G must be whole lanes."""
    x = jnp.pad(x, [(0, 0), (0, lay.nt * lay.tb - lay.T), (0, 0)], constant_values=fill)
    x = jnp.transpose(x.reshape(lay.B, lay.nt * lay.tb, lay.H, lay.G), (0, 2, 1, 3))
    return x.reshape(lay.B, lay.H, 1, lay.nt * lay.tb * lay.G)


def _lane_column(ref):
    """A `_lane_rows` block (1, R) as the column [R, 1] (as splash's backward reads its logsumexp)."""
    return jnp.expand_dims(ref[0], -1)


def _lane_row(column):
    """A column [R, 1] float32 as a `_lane_rows` block (1, R): broadcast over the lanes, transposed (a 32-bit
    transpose of whole (8, 128) tiles on the XLU, R a multiple of 128), its first row."""
    return jnp.broadcast_to(column, (column.shape[0], lanes())).T[:1]


def _is_lane_rows(shape):
    """Whether an array of a resident kernel's call is lane rows [B, H, 1, Tp * G] (not [B, H, KR, Dp] in HBM)."""
    return len(shape) == 4 and shape[2] == 1


def _from_lane_rows(x, lay):
    """The inverse of `_lane_rows`: [B, H, 1, Tp * G] -> [B, T, HQ]."""
    x = jnp.transpose(x.reshape(lay.B, lay.H, lay.nt * lay.tb, lay.G), (0, 2, 1, 3))
    return x.reshape(lay.B, lay.nt * lay.tb, lay.H * lay.G)[:, :lay.T]


def _from_token_rows(x, lay, d):
    """[B, Tp, H, G, Dp] -> [B, T, HQ, d]."""
    return x.reshape(lay.B, lay.nt * lay.tb, lay.H * lay.G, x.shape[4])[:, :lay.T, :, :d]


def _resident_names(block_indices, block_counts, cu_seqlens, lay, block_size):
    """int32 [B, H, NT, TB, S]: each token's slots named by their blocks' first key rows (NONE: skipped)."""
    return tile_names(block_names(block_indices, block_counts, cu_seqlens, None, block_size=block_size), lay.tb)


def _tile_tokens(lay):
    """int32 [NT, TB]: the key row (= index) of each token of each tile."""
    return jnp.arange(lay.nt, dtype=jnp.int32)[:, None] * lay.tb + jnp.arange(lay.tb, dtype=jnp.int32)


def _seen_last(names, token, block_size):
    """The last row of each named block that `token` sees: min(block_size - 1, token - name), -1 where NONE."""
    return jnp.where(names == NONE, -1, jnp.minimum(block_size - 1, token - names))


def _first_to_front(x, flags):
    """x [..., N] with its first entry where flags [..., N] is True (none: entry 0) swapped with entry 0, by selects
    (on a TPU v5e a sort or gather of the table's [B, H, NT, TB, SP] entries took some 20 ms at 8k tokens)."""
    slot = jnp.arange(x.shape[-1])
    first = jnp.argmax(flags, axis=-1)[..., None]
    at_first = jnp.sum(jnp.where(slot == first, x, 0), axis=-1, keepdims=True)
    return jnp.where(slot == 0, at_first, jnp.where(slot == first, x[..., :1], x))


def _flag_at(tokens, slots):
    """Where a `_resident_table` row holds its step's flag: past its TB tokens' SP source rows and SP last rows."""
    return 2 * tokens * slots


def _resident_table(names, lay, block_size):
    """int32 [B, H, NT, 1, 2 * TB * SP + 1]: per tile, from its `_resident_names`, each token's slots, the first it
    sees in part moved to the front (`_first_to_front`): their source rows in `_key_rows` (a slot it sees nothing
    of, skipped or past it: the zero rows, `_zero_row`), then the last row of its block each sees (-1: nothing);
    then, at `_flag_at`, 1 where every token of the step sees at most one slot in part (its first: `_token_path`
    zeroes no other), 0 else."""
    slots = _padded_slots(lay.S, lay.br)
    names = jnp.pad(names, [(0, 0)] * 4 + [(0, slots - lay.S)], constant_values=NONE)  # [B, H, NT, TB, SP]
    last = _seen_last(names, _tile_tokens(lay)[..., None], block_size)
    partial = (last >= 0) & (last < lay.br - 1)
    names, last = (_first_to_front(x, partial) for x in (names, last))
    unseen = last < 0
    rows = jnp.where(unseen, _zero_row(lay), _copy_rows(jnp.where(unseen, 0, names), lay, block_size))
    simple = jnp.all(jnp.sum(partial, axis=-1) <= 1, axis=-1)  # [B, H, NT]
    flat = lambda x: x.reshape(x.shape[:3] + (-1,)).astype(jnp.int32)
    return jnp.concatenate([flat(rows), flat(last), simple[..., None].astype(jnp.int32)], axis=-1)[..., None, :]


# The union tiles of the resident forward and backward. On a trained model's selections neighbouring tokens list much
# the same blocks; a tile of UT tokens (`_union_tokens`: UT * G ~ MXU_ROWS rows) whose tokens list U <= UC distinct
# blocks (`_union_slots`: UNION_CAP * S, padded to whole lanes) runs as one [UT * G, UC * BR] logits matmul against the
# union's gathered rows, each row masked to its token's own blocks and rows, instead of UT matmuls of G rows: at G = 16,
# UT = 8 fills the MXU's 128 rows for at most UNION_CAP times the per-token work. A union tile must also lie within one
# sequence and list no block twice in one token (a repeated block weighs twice; the union lists it once), else it runs
# token by token; `_union_table` makes that choice per tile in XLA, from the selections. The two paths round differently
# (one softmax over UC * BR columns, or SP * BR): results agree with the reference within the usual tolerance, not
# bitwise across paths. A key row a token does not see never reaches its output through a row that is zeroed (past the
# last row any token of the tile sees, or a slot that is not in the union); a row that a later token of the same
# sequence and union tile sees but this one does not reaches it as 0 * that row in p v, as in dense attention under a
# causal mask: a non-finite key or value row of a sequence's own tokens (which makes its later queries' outputs
# non-finite anyway) reaches the earlier queries of its union tile.
#
# The backward takes the same tiles (`_step_table`'s flags) in each of its passes: a union tile's k (and v where the
# pass reads it) gathered once as in the forward, its tokens' q, do, lse and delta stacked into [UT * G, .], one
# `_gradients` of [UT * G, UC * BR] (dq written back per token; dk = ds^T q and dv = p^T do [UC * BR, Dp] of 128
# rows at G = 16, their transposes aligned), then each union slot's BR rows of dk, dv added into the float32 sums at
# its source row, slot after slot (a fixed order: bitwise repeatable, and bitwise in two passes as in one). An empty
# slot (past the union's U blocks) is not added: its rows of dk, dv are zeros (its columns of p and ds are 0, q and
# do finite), so adding them to row 0 would change no bit of a sum, only cost a read and write of BR rows. As in the
# forward, a non-finite key or value row that a later token of the union tile sees reaches the earlier tokens' ds
# (0 * it in do v^T) and dq (0 * it in ds k).

UNION_CAP = 2  # a union tile holds at most UNION_CAP * S distinct blocks: at most ~2x the per-token path's work
UNION_TILES = True  # False: every tile token by token (scripts/tpu_train_probe.py's baseline for part union)


def _union_tokens(lay):
    """UT: the tokens of a union tile, the largest power of two <= MXU_ROWS / G dividing TB (1: no union tiles, G
    alone fills the MXU, or UNION_TILES off)."""
    if not UNION_TILES:
        return 1
    ut = 1
    while ut * 2 * lay.G <= MXU_ROWS and lay.tb % (ut * 2) == 0:
        ut *= 2
    return ut


def _union_slots(lay):
    """UC: the blocks a union tile gathers, UNION_CAP * S padded so that UC * BR columns are whole lanes."""
    return _padded_slots(UNION_CAP * lay.S, lay.br)


def _sequence_ids(cu_seqlens, lay):
    """int32 [NT, TB]: the sequence of each token of each tile (padded tokens: that of token T - 1), all 0 without
    cu_seqlens."""
    token = jnp.minimum(_tile_tokens(lay), lay.T - 1)
    if cu_seqlens is None:
        return jnp.zeros_like(token)
    return jnp.searchsorted(cu_seqlens.astype(jnp.int32), token, side="right").astype(jnp.int32)


def _repeats(names):
    """bool [..., N]: whether each entry of names [..., N] is a name (not NONE) that an earlier entry (lower index)
    lists too, by pairwise compares [..., N, N] (the earlier entry on the second-minor axis) reduced by any."""
    n = names.shape[-1]
    earlier = jnp.arange(n)[:, None] < jnp.arange(n)  # [N (earlier), N]
    same = (names[..., :, None] == names[..., None, :]) & earlier
    return jnp.any(same, axis=-2) & (names != NONE)


def _distinct(names, size):
    """(int32 [..., size]: the distinct names of names [..., N] in the order of their first occurrences, NONE-padded,
    those past `size` dropped; int32 [...]: how many, dropped ones included), by compares, a cumsum and sums (no sort
    or gather: XLA's are slow on a TPU). Slot u holds the first occurrence that u first occurrences precede, picked by
    a one-hot sum [..., size, N]."""
    first = (names != NONE) & ~_repeats(names)
    ones = first.astype(jnp.int32)
    slot = jnp.cumsum(ones, axis=-1) - ones  # [..., N]: the first occurrences before each entry
    u = jnp.arange(size, dtype=jnp.int32)
    picked = first[..., None, :] & (slot[..., None, :] == u[:, None])  # [..., size, N]
    union = jnp.sum(jnp.where(picked, names[..., None, :], 0), axis=-1)
    count = jnp.sum(ones, axis=-1)
    return jnp.where(u < count[..., None], union, NONE), count


def _union_table(names, cu_seqlens, lay, block_size):
    """int32 [B, H, NT, 1, NU * (1 + (2 + UT) * UC)], the union tiles of the resident forward and backward from their
    `_resident_names` [B, H, NT, TB, S]: per union tile of the step (NU = TB / UT), 1 where it takes the union path,
    then its union's source rows in `_key_rows` (its `_distinct` blocks, in the order of their first occurrences; 0:
    an empty slot), the last row of each that any of its tokens sees (-1: an empty slot, zeroed whole), and for each
    of its UT tokens the last row of each that it sees (-1: not listed), for `_union_seen`. By compares, selects, sums
    and a cumsum, no sort or gather (XLA's are slow on a TPU v5e), but for packed sequences' searches of cu_seqlens
    (`_sequence_ids`, `_copy_rows`)."""
    B, H, nt, tb, S = names.shape
    ut, uc = _union_tokens(lay), _union_slots(lay)
    tiles = names.reshape(B, H, nt, tb // ut, ut, S)
    union, count = _distinct(tiles.reshape(B, H, nt, tb // ut, ut * S), uc)  # [B, H, NT, NU, UC], [B, H, NT, NU]
    repeated = jnp.any(_repeats(tiles), axis=(-2, -1))  # a token lists a block twice
    seq = _sequence_ids(cu_seqlens, lay).reshape(nt, tb // ut, ut)
    one_sequence = jnp.all(seq == seq[..., :1], axis=-1)
    takes = (count <= uc) & ~repeated & one_sequence
    token = _tile_tokens(lay).reshape(nt, tb // ut, ut)[..., None]  # [NT, NU, UT, 1]
    listed = jnp.any(tiles[..., None, :] == union[..., None, :, None], axis=-1) & (union[..., None, :] != NONE)
    last = jnp.where(listed, _seen_last(union[..., None, :], token, block_size), -1)  # [B, H, NT, NU, UT, UC]
    empty = union == NONE
    rows = jnp.where(empty, 0, _copy_rows(jnp.where(empty, 0, union), lay, block_size))
    table = jnp.concatenate([takes[..., None].astype(jnp.int32), rows, jnp.max(last, axis=-2),
                             last.reshape(B, H, nt, tb // ut, ut * uc)], axis=-1)
    return table.reshape(B, H, nt, 1, -1).astype(jnp.int32)


def _step_table(block_indices, block_counts, cu_seqlens, lay, block_size):
    """int32 [B, H, NT, 1, .], the table row per grid step that the resident forward and every backward pass read:
    `_resident_table`'s, followed by `_union_table`'s where there are union tiles (`_union_tokens` > 1)."""
    names = _resident_names(block_indices, block_counts, cu_seqlens, lay, block_size)
    table = _resident_table(names, lay, block_size)
    if _union_tokens(lay) == 1:
        return table
    return jnp.concatenate([table, _union_table(names, cu_seqlens, lay, block_size)], axis=-1)


def union_tiles(q, k, v, block_indices, block_counts, cu_seqlens, *, block_size):
    """bool [B, H, NT, NU]: which union tiles of the resident forward and backward take the union path
    (`_union_table`) on these inputs; all False where G fills the MXU alone (no union tiles)."""
    lay = _resident_layout(q, k, v, block_indices, block_size, cu_seqlens)
    if _union_tokens(lay) == 1:
        return jnp.zeros((lay.B, lay.H, lay.nt, lay.tb), bool)
    names = _resident_names(block_indices, block_counts, cu_seqlens, lay, block_size)
    table = _union_table(names, cu_seqlens, lay, block_size)
    return table.reshape(lay.B, lay.H, lay.nt, lay.tb // _union_tokens(lay), -1)[..., 0] == 1


ZEROED_ROWS = 64  # rows of a float32 sum zeroed per loop step (8 vregs at Dp = 128)


def _zero(ref):
    """ref [KR, Dp] = 0, ZEROED_ROWS rows a loop step, then the rest: one store of the whole (32 MiB at 64k tokens)
    would unroll into a vreg store each."""
    full = ref.shape[0] // ZEROED_ROWS

    def step(i, carry):
        ref[pl.ds(pl.multiple_of(i * ZEROED_ROWS, ZEROED_ROWS), ZEROED_ROWS), :] = jnp.zeros(
            (ZEROED_ROWS, ref.shape[1]), ref.dtype)
        return carry

    lax.fori_loop(0, full, step, 0)
    if ref.shape[0] > full * ZEROED_ROWS:
        ref[full * ZEROED_ROWS:, :] = jnp.zeros((ref.shape[0] - full * ZEROED_ROWS, ref.shape[1]), ref.dtype)


def _row_start(copies, sums):
    """At the first step of a (b, h) row of the grid: `copies` (HBM -> VMEM, its resident k and v rows) run, the
    float32 `sums` are zeroed meanwhile."""
    @pl.when(pl.program_id(2) == 0)
    def _start():
        for copy in copies:
            copy.start()
        for ref in sums:
            _zero(ref)
        for copy in copies:
            copy.wait()


def _row_end(copies):
    """At the last step of a (b, h) row of the grid: `copies` (VMEM -> HBM, its dk, dv sums) run to completion."""
    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _end():
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()


def _gather(tab_ref, rows_at, last_at, pairs, *, slots, br, align, base=0, zeroed=None):
    """`slots` blocks, for each (resident rows [KR, Dp], buffer [., Dp]) of `pairs` (k's, and v's where read): slot
    s's BR rows from its source row tab_ref[0, rows_at + s], at rows base + s * BR; in the first `zeroed` slots (all:
    None) those past the last row of the slot that its token (or union tile) sees, tab_ref[0, last_at + s] (every
    row of a skipped slot: -1), zeroed: they hold a later token's rows, another sequence's, or stale ones, and 0 * NaN
    would leak into p v (forward), do v^T and ds k (backward). The slots past `zeroed` are copied as they are (on a
    TPU v5e a select per bfloat16 row took 3.4 of the forward's 19.8 ms at 8k: 2026-12-07)."""
    c = lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    for s in range(slots):
        src = pl.ds(pl.multiple_of(tab_ref[0, rows_at + s], align), br)
        keep = c <= tab_ref[0, last_at + s]
        for rows, buf in pairs:
            block = rows[src, :] if zeroed is not None and s >= zeroed else jnp.where(keep, rows[src, :], 0)
            buf[pl.ds(base + s * br, br), :] = block.astype(buf.dtype)


def _copy_start(copy, slots, br):
    """The first row of copy `copy` of a gathered buffer of `slots` blocks of BR rows, copy * slots * BR: a token
    buffer [UNROLL * SP * BR, Dp] holds a copy per token of a `_token_loop` step, a union buffer [UC * BR, Dp] one
    (copy 0)."""
    return copy * slots * br


def _token_gather(tab_ref, j, pairs, *, slots, br, align, tokens, copy, zeroed):
    """Token j's blocks (`_gather`, its first `zeroed` slots zeroed past their last rows seen) into copy `copy` of
    the buffers (`_copy_start`): its slots' source rows and last rows from the `_resident_table` row."""
    _gather(tab_ref, j * slots, (tokens + j) * slots, pairs, slots=slots, br=br, align=align,
            base=_copy_start(copy, slots, br), zeroed=zeroed)


def _copy_of(ref, copy, slots, br):
    """Copy `copy` of a gathered buffer of `slots` blocks (`_copy_start`): its slots * BR rows, loaded."""
    start = _copy_start(copy, slots, br)
    return ref[start:start + slots * br]


def _token_loop(first, count, token, unroll):
    """token(first + i, i % unroll) for i in 0 .. count - 1, in order, `unroll` tokens a loop step: each of a step's
    tokens gathers into its own copy of the buffers, so that the scheduler may overlap one token's gather and
    matmuls with the next's (a fori_loop's own `unroll` gave wrong results on a TPU v5e: 2026-12-07)."""
    def step(i, carry):
        for u in range(unroll):
            token(first + i * unroll + u, u)
        return carry

    lax.fori_loop(0, count // unroll, step, 0)


def _token_path(tab_ref, token, first, count, *, tokens, slots, unroll):
    """Tokens first .. first + count - 1 of a step token by token (`_token_loop`), token(j, copy, zeroed): where the
    step's `_resident_table` flag says every token sees at most its first slot in part (selections that list no
    block twice), each token's gather zeroes that slot alone, `unroll` tokens a loop step; else every slot, one
    token a loop step (a rare path, kept small)."""
    simple = tab_ref[0, _flag_at(tokens, slots)] == 1
    pl.when(simple)(lambda: _token_loop(first, count, functools.partial(token, zeroed=1), unroll))
    pl.when(jnp.logical_not(simple))(lambda: _token_loop(first, count, functools.partial(token, zeroed=None), 1))


def _seen_limits(tab_ref, last_at, *, slots, br):
    """int32 [1, slots * BR]: the last gathered column each column's slot is seen to, s * BR + tab_ref[0, last_at + s]
    for the columns of slot s (its last row seen; -1: skipped, so below every column of it). Built per 128 lanes
    from the slots that reach into them (each a scalar)."""
    lane = lanes()
    pieces = []
    for g in range(slots * br // lane):
        col = g * lane + lax.broadcasted_iota(jnp.int32, (1, lane), 1)
        limit = jnp.full((1, lane), -1, jnp.int32)
        for s in range(g * lane // br, min(slots, ((g + 1) * lane - 1) // br + 1)):
            limit = jnp.where(col >= s * br, s * br + tab_ref[0, last_at + s], limit)
        pieces.append(limit)
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _seen_columns(tab_ref, j, *, slots, br, tokens):
    """bool [1, SP * BR]: the gathered rows token j sees, column s * BR + c iff c <= the last row of slot s it sees
    (the `_resident_table` row's second half)."""
    limit = _seen_limits(tab_ref, (tokens + j) * slots, slots=slots, br=br)
    return lax.broadcasted_iota(jnp.int32, limit.shape, 1) <= limit


def _transposed_dot(a, b, precision):
    """a^T @ b, float32, for a [G, N] float32 and b [G, D]: the G rows padded to a whole MXU pass and transposed
    in float32, so that Mosaic transposes an aligned [128, N] (it has refused padded transposes: jax issue 18370),
    then rounded to b's dtype."""
    rows = round_up(a.shape[0], MXU_ROWS)
    return dot(padded(a, 0, rows).T.astype(b.dtype), padded(b, 0, rows), precision)


def _softmax_rows(s, seen, v, precision):
    """(o [R, Dvp] float32, lse [R, 1]) of logits s [R, N] over the columns `seen` (bool [R, N]) against v [N, Dvp]:
    a row that sees nothing gets o = 0, lse = -inf (no NaN: its logits are -inf by `where`, never 0 * NaN)."""
    s = jnp.where(seen, s, -jnp.inf)
    m = jnp.max(s, axis=1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=1, keepdims=True)
    some = l > 0
    o = dot(p.astype(v.dtype), v, precision) / jnp.where(some, l, 1.0)
    return o, jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)


def _union_at(n, *, tokens, slots, union_tokens, union_slots):
    """Where union tile n of a step starts in its table row (`_step_table`): past `_resident_table`'s 2 * TB * SP
    + 1 entries and the 1 + (2 + UT) * UC `_union_table` entries of each union tile before it."""
    return _flag_at(tokens, slots) + 1 + n * (1 + (2 + union_tokens) * union_slots)


def _each_tile(tab_ref, token, union, *, tokens, slots, union_tokens, union_slots, unroll):
    """A grid step's TB tokens, in order: token(j, copy, zeroed) for each (`_token_path`) where there are no union
    tiles (union_tokens UT = 1); else, per union tile n of the step's TB / UT (its entries at `_union_at`, its
    tokens first = n * UT .. first + UT - 1), union(at, first) where its flag tab_ref[0, at] is 1, token(j, copy,
    zeroed) for each of its tokens else."""
    path = functools.partial(_token_path, tab_ref, token, tokens=tokens, slots=slots, unroll=unroll)
    if union_tokens == 1:
        path(0, tokens)
        return
    for n in range(tokens // union_tokens):
        at = _union_at(n, tokens=tokens, slots=slots, union_tokens=union_tokens, union_slots=union_slots)
        first = n * union_tokens
        takes = tab_ref[0, at] == 1
        pl.when(takes)(functools.partial(union, at, first))

        pl.when(jnp.logical_not(takes))(functools.partial(path, first, union_tokens))


def _union_gather(tab_ref, at, pairs, *, slots, br, align):
    """A union tile's blocks (`_gather`) into pairs' buffers [UC * BR, Dp]: its union's source rows and the last row
    of each that any of its tokens sees, from its `_union_table` entries at `at` (its flag first)."""
    _gather(tab_ref, at + 1, at + 1 + slots, pairs, slots=slots, br=br, align=align)


def _union_seen(tab_ref, at, *, tokens, heads, slots, br):
    """bool [UT * G, UC * BR]: row j * G + g (token j of the union tile whose `_union_table` entries start at `at`,
    head g) sees column u * BR + c of the tile's gathered rows iff c <= the last row of union block u that token j
    sees, tab_ref[0, at + 1 + (2 + j) * UC + u] (-1: token j does not list it): each token's `_seen_limits` spread
    over its G rows (int32, whole sublane tiles)."""
    limits = [_seen_limits(tab_ref, at + 1 + (2 + j) * slots, slots=slots, br=br) for j in range(tokens)]
    rows = jnp.concatenate([jnp.broadcast_to(limit, (heads, slots * br)) for limit in limits])
    return lax.broadcasted_iota(jnp.int32, rows.shape, 1) <= rows


def _stacked(ref, first, tokens):
    """[UT * G, .]: the G rows of tokens first .. first + UT - 1 of a (TB, G, .) block ref, token j's at j * G."""
    return jnp.concatenate([ref[first + j] for j in range(tokens)])


def _unstack(ref, first, x):
    """The inverse of `_stacked`: ref[first + j] = x's rows j * G .. (j + 1) * G - 1 in ref's dtype, for each token j
    of x [UT * G, .]."""
    heads = ref.shape[1]
    for j in range(x.shape[0] // heads):
        ref[first + j] = x[j * heads:(j + 1) * heads].astype(ref.dtype)


def _union_forward(tab_ref, q_ref, o_ref, lse_ref, pairs, at, first, *, tokens, slots, br, align, scale, precision):
    """The union tile of a step's tokens first .. first + tokens - 1, its `_union_table` entries from `at`: the
    union's blocks gathered once into pairs' buffers [UC * BR, Dp] (`_union_gather`), the tokens' G rows each stacked
    into one [UT * G, Dkp] query, one masked softmax (`_union_seen`), each token's G rows of o and lse written back."""
    _union_gather(tab_ref, at, pairs, slots=slots, br=br, align=align)
    (_, k_union), (_, v_union) = pairs
    q = _stacked(q_ref, first, tokens)  # [UT * G, Dkp]
    s = dot(q, k_union[...], precision, transpose_b=True) * scale  # [UT * G, UC * BR]
    seen = _union_seen(tab_ref, at, tokens=tokens, heads=q_ref.shape[1], slots=slots, br=br)
    o, lse = _softmax_rows(s, seen, v_union[...], precision)
    _unstack(o_ref, first, o)
    _unstack(lse_ref, first, lse)


def _resident_fwd_kernel(tab_ref, q_ref, *refs, scale, slots, br, align, precision, union_tokens, union_slots,
                         unroll):
    """Grid (B, H, NT), a step one tile of TB tokens. Loads q_ref (TB, G, Dkp) by BlockSpec and, at the (b, h)'s first
    step, its rows of k_hbm, v_hbm [B, H, KR, Dp] (HBM) into k_ref, v_ref [KR, Dp] (`_row_start`); writes o_ref (TB, G,
    Dvp), lse_ref (TB, G, 1), or a (1, TB * G) lane row (`_lane_rows`) from lse_rows (TB, G, 1) at the step's end; the
    scratch of `_resident_scratch` by name: k_buf, v_buf [UNROLL * SP * BR, Dp] the gathered blocks of a `_token_loop`
    step's tokens, a copy each, k_union, v_union [UC * BR, Dp] a union tile's (where union_tokens UT > 1). The table row
    (SMEM, `_step_table`): each of the step's TB / UT union tiles of UT tokens runs as one [UT * G, UC * BR] softmax
    (`_union_forward`) where its flag is 1, token by token (G rows against SP * BR) else (`_each_tile`)."""
    k_hbm, v_hbm, o_ref, lse_out = refs[:4]
    names = _resident_scratch_names(FORWARD, union_tokens > 1, lane_rows=len(lse_out.shape) == 2)
    r = dict(zip(names, refs[4:]))
    sems = refs[4 + len(names)]
    k_ref, v_ref, k_buf, v_buf, k_union, v_union = (r.get(x) for x in ("k", "v", "k_buf", "v_buf", "k_union",
                                                                       "v_union"))
    lse_ref = r.get("lse_rows", lse_out)
    tokens = q_ref.shape[0]
    b, h = pl.program_id(0), pl.program_id(1)
    _row_start([pltpu.make_async_copy(k_hbm.at[b, h], k_ref, sems.at[0]),
                pltpu.make_async_copy(v_hbm.at[b, h], v_ref, sems.at[1])], [])

    def token(j, copy, zeroed):
        _token_gather(tab_ref, j, [(k_ref, k_buf), (v_ref, v_buf)], slots=slots, br=br, align=align, tokens=tokens,
                      copy=copy, zeroed=zeroed)
        s = dot(q_ref[j], _copy_of(k_buf, copy, slots, br), precision, transpose_b=True) * scale  # [G, SP * BR]
        o, lse = _softmax_rows(s, _seen_columns(tab_ref, j, slots=slots, br=br, tokens=tokens),
                               _copy_of(v_buf, copy, slots, br), precision)
        o_ref[j] = o.astype(o_ref.dtype)
        lse_ref[j] = lse

    union = functools.partial(_union_forward, tab_ref, q_ref, o_ref, lse_ref, [(k_ref, k_union), (v_ref, v_union)],
                              tokens=union_tokens, slots=union_slots, br=br, align=align, scale=scale,
                              precision=precision)
    _each_tile(tab_ref, token, union, tokens=tokens, slots=slots, union_tokens=union_tokens, union_slots=union_slots,
               unroll=unroll)
    if "lse_rows" in r:
        lse_out[...] = _lane_row(_stacked(lse_ref, 0, tokens))


def _gradients(q, do, lse, delta, k, v, seen, *, outputs, scale, precision):
    """(dq [R, Dkp] float32, None unless computed; {dk, dv of `outputs`: [N, Dp] float32, dk unscaled}) of R query
    rows q [R, Dkp], do [R, Dvp], lse, delta [R, 1] float32 against N gathered rows k [N, Dkp], v [N, Dvp] (None in a
    pass that reads no v), row r seeing column n where seen [R or 1, N]: p = exp(q k^T * scale - lse) where seen and
    lse > -inf, else 0; ds = p (do v^T - delta); dq = ds k * scale, dk = ds^T q, dv = p^T do (`_transposed_dot`)."""
    s = dot(q, k, precision, transpose_b=True) * scale  # [R, N]
    seen = seen & (lse > -jnp.inf)
    p = jnp.where(seen, jnp.exp(s - jnp.where(lse > -jnp.inf, lse, 0.0)), 0.0)
    dq, grads = None, {}
    if "dv" in outputs:
        grads["dv"] = _transposed_dot(p, do, precision)  # [N, Dvp]
    if v is not None:
        ds = p * (dot(do, v, precision, transpose_b=True) - delta)
        if "dq" in outputs:
            dq = dot(ds.astype(k.dtype), k, precision) * scale
        if "dk" in outputs:
            grads["dk"] = _transposed_dot(ds, q, precision)  # [N, Dkp]
    return dq, grads


def _add_slots(tab_ref, rows_at, grads, sums, *, slots, br, align, last_at=None):
    """For each slot s in order, each float32 sum g of `sums` ({name: [KR, Dp] ref}) += grads[g]'s rows s * BR ..
    (s + 1) * BR - 1 at its BR rows from the slot's source row tab_ref[0, rows_at + s]; where last_at is given, only
    at the slots whose last row seen tab_ref[0, last_at + s] is >= 0 (a union tile's empty slots, whose rows of
    grads are zeros, are not added to row 0)."""
    for s in range(slots):
        def add(s=s):
            rows = pl.ds(pl.multiple_of(tab_ref[0, rows_at + s], align), br)
            for g, ref in sums.items():
                ref[rows, :] += grads[g][s * br:(s + 1) * br]

        if last_at is None:
            add()
        else:
            pl.when(tab_ref[0, last_at + s] >= 0)(add)


def _resident_bwd_kernel(tab_ref, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, *refs, outputs, scale, slots, br,
                         align, precision, union_tokens, union_slots, unroll):
    """Grid (B, H, NT), a step one tile of TB tokens, in order along the (b, h)'s row: one pass of the backward,
    computing `outputs` (some of dq, dk, dv). Loads q_ref, do_ref (TB, G, Dp), lse_ref, delta_ref (TB, G, 1), or
    (1, TB * G) lane rows (`_lane_rows`) that it first writes as (TB, G, 1) into lse_rows, delta_rows, by
    BlockSpec and, at the row's first step, its rows of k_hbm (and v_hbm, where `_keys_read`) [B, H, KR, Dp] (HBM)
    into VMEM. refs: the outputs (dq (TB, G, Dkp) its own tile; dk, dv [B, H, KR, Dp] float32 in HBM, the unscaled
    dk), then the scratch of `_resident_scratch` in its order, then the DMA semaphores: dk_sum, dv_sum are zeroed at
    the row's first step, added to at each token's slots' rows, copied out at its last. As in the forward
    (`_each_tile`), each union tile whose flag is 1 (union_tokens UT > 1) runs as one: its union's blocks gathered
    into k_union (and v_union) [UC * BR, Dp], its tokens' rows stacked into [UT * G, .], `_gradients` of [UT * G, UC
    * BR], dq written back per token, dk and dv added at the union's non-empty slots' rows; other tiles token by
    token (G rows against SP * BR)."""
    out = dict(zip(outputs, refs))
    names = _resident_scratch_names(outputs, union_tokens > 1, lane_rows=len(lse_ref.shape) == 2)
    r = dict(zip(names, refs[len(outputs):]))
    sems = refs[len(outputs) + len(names)]
    if "lse_rows" in r:  # lane rows: their [TB * G, 1] columns, token j's G rows at [j]
        for row, name in ((lse_ref, "lse_rows"), (delta_ref, "delta_rows")):
            _unstack(r[name], 0, _lane_column(row))
        lse_ref, delta_ref = r["lse_rows"], r["delta_rows"]
    tokens, b, h = q_ref.shape[0], pl.program_id(0), pl.program_id(1)
    keys = [("k", k_hbm)] + ([("v", v_hbm)] if "v" in r else [])
    sums = {g: r[g + "_sum"] for g in ("dk", "dv") if g in outputs}
    _row_start([pltpu.make_async_copy(x.at[b, h], r[name], sems.at[n]) for n, (name, x) in enumerate(keys)],
               list(sums.values()))
    pairs = lambda kind: [(r[name], r[name + kind]) for name, _ in keys]  # (resident rows, gathered buffer)
    grads_of = functools.partial(_gradients, outputs=outputs, scale=scale, precision=precision)

    def gathered(kind, copy, count):
        """(k, v) as gathered into copy `copy` of the `kind` buffers ("_buf": a token's, "_union": a union tile's),
        `count` slots each (`_copy_of`); v None in a pass that reads no v."""
        return tuple(_copy_of(r[name + kind], copy, count, br) if name in r else None for name in ("k", "v"))

    def token(j, copy, zeroed):
        _token_gather(tab_ref, j, pairs("_buf"), slots=slots, br=br, align=align, tokens=tokens, copy=copy,
                      zeroed=zeroed)
        seen = _seen_columns(tab_ref, j, slots=slots, br=br, tokens=tokens)
        k, v = gathered("_buf", copy, slots)
        dq, grads = grads_of(q_ref[j], do_ref[j], lse_ref[j], delta_ref[j], k, v, seen)
        if dq is not None:
            out["dq"][j] = dq.astype(out["dq"].dtype)
        _add_slots(tab_ref, j * slots, grads, sums, slots=slots, br=br, align=align)

    def union(at, first):
        _union_gather(tab_ref, at, pairs("_union"), slots=union_slots, br=br, align=align)
        seen = _union_seen(tab_ref, at, tokens=union_tokens, heads=q_ref.shape[1], slots=union_slots, br=br)
        rows = [_stacked(x, first, union_tokens) for x in (q_ref, do_ref, lse_ref, delta_ref)]  # [UT * G, .]
        dq, grads = grads_of(*rows, *gathered("_union", 0, union_slots), seen)
        if dq is not None:
            _unstack(out["dq"], first, dq)
        _add_slots(tab_ref, at + 1, grads, sums, slots=union_slots, br=br, align=align, last_at=at + 1 + union_slots)

    _each_tile(tab_ref, token, union, tokens=tokens, slots=slots, union_tokens=union_tokens, union_slots=union_slots,
               unroll=unroll)
    _row_end([pltpu.make_async_copy(ref, out[g].at[b, h], sems.at[n]) for n, (g, ref) in enumerate(sums.items())])


def _resident_call(kernel, lay, table, tiled, k_rows, v_rows, outputs, *, computes, q, scale, interpret, name):
    """pallas_call of a resident kernel on the grid (B, H, NT), NT "arbitrary" (a row's steps in order: `_row_start`,
    `_row_end`): the table row (SMEM), the tiled inputs [B, Tp, H, G, .] (TB tokens each), k and v [B, H, KR, Dp] in
    HBM; `outputs` (those of `computes`, FORWARD or some of dq, dk, dv, in its order) [B, Tp, H, G, .] per tile, or
    4-d [B, H, KR, Dp] in HBM (the backward's dk, dv); the scratch of `_resident_scratch` and two DMA semaphores
    (k and v in, dk and dv out). Scoped VMEM: `resident_bytes` + RESIDENT_MARGIN, at least the default, at most the
    chip's."""
    slots = _padded_slots(lay.S, lay.br)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)

    def tile_spec(shape):  # [B, Tp, H, G, .]: the (TB, G, .) tile of tokens i * TB ... of KV head h
        if _is_lane_rows(shape):  # [B, H, 1, Tp * G]: (1, TB * G)
            return pl.BlockSpec((None, None, 1, lay.tb * lay.G), lambda b, h, i: (b, h, 0, i))
        return pl.BlockSpec((None, lay.tb, None) + shape[3:], lambda b, h, i: (b, i, h) + (0,) * (len(shape) - 3))

    semantics = ("parallel", "parallel", "arbitrary")
    need = resident_bytes(lay, k_rows.dtype, computes) + RESIDENT_MARGIN
    compiler = pltpu.CompilerParams(dimension_semantics=semantics,
                                    vmem_limit_bytes=int(min(facts("tpu").vmem, max(need, facts("tpu").scoped_vmem))))
    _, dots = params(q, interpret, semantics)
    scratch = _resident_scratch(lay, k_rows.dtype, computes)
    return pl.pallas_call(
        functools.partial(kernel, scale=float(scale), slots=slots, br=lay.br, align=sublanes(k_rows.dtype),
                          union_tokens=_union_tokens(lay), union_slots=_union_slots(lay), unroll=RESIDENT_UNROLL,
                          **dots),
        grid=(lay.B, lay.H, lay.nt),
        in_specs=[pl.BlockSpec((None, None, None) + table.shape[3:], lambda b, h, i: (b, h, i, 0, 0),
                               memory_space=pltpu.SMEM)] + [tile_spec(x.shape) for x in tiled] + [hbm, hbm],
        out_specs=[hbm if len(o.shape) == 4 and not _is_lane_rows(o.shape) else tile_spec(o.shape) for o in outputs],
        out_shape=outputs,
        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch.values()]
        + [pltpu.SemaphoreType.DMA((2,))], name=name, compiler_params=compiler, interpret=interpret,
    )(table, *tiled, k_rows, v_rows)


def _resident_attention(q, k, v, block_indices, block_counts, cu_seqlens, *, block_size, scale, interpret):
    """`_attention`'s o and lse by the resident forward, its union tiles (`_step_table`) where G leaves room."""
    lay = _resident_layout(q, k, v, block_indices, block_size, cu_seqlens)
    table = _step_table(block_indices, block_counts, cu_seqlens, lay, block_size)
    rows = (lay.B, lay.nt * lay.tb, lay.H, lay.G)
    lanes_in = _stats_in_lanes(lay)
    lse_shape = (lay.B, lay.H, 1, lay.nt * lay.tb * lay.G) if lanes_in else rows + (1,)
    o, lse = _resident_call(
        _resident_fwd_kernel, lay, table, [_token_rows(q, lay, lay.dkp)], _key_rows(k, lay, lay.dkp),
        _key_rows(v, lay, lay.dvp),
        [out_struct(rows + (lay.dvp,), q.dtype, q), out_struct(lse_shape, jnp.float32, q)],
        computes=FORWARD, q=q, scale=scale, interpret=interpret, name="selected_resident_forward")
    lse = _from_lane_rows(lse, lay) if lanes_in else _from_token_rows(lse, lay, 1)[..., 0]
    return _from_token_rows(o, lay, v.shape[3]), lse


def _resident_backward(q, k, v, block_indices, block_counts, cu_seqlens, o, lse, do, *, passes, block_size, scale,
                       interpret):
    """`backward`'s (dq, dk, dv) by the resident backward in `passes` (`resident_plan`'s), taking the forward's union
    tiles (`_step_table`): one kernel call per pass, named selected_resident_backward (one pass) or
    selected_resident_backward_ followed by its outputs (dq_dk, dv)."""
    lay = _resident_layout(q, k, v, block_indices, block_size, cu_seqlens)
    table = _step_table(block_indices, block_counts, cu_seqlens, lay, block_size)
    delta = kernel_delta(o, do, q.dtype)
    rows = lambda x, dp, fill=0.0: _token_rows(x, lay, dp, fill)
    stats = ((_lane_rows(lse, lay, -jnp.inf), _lane_rows(delta, lay)) if _stats_in_lanes(lay)
             else (rows(lse[..., None], 1, -jnp.inf), rows(delta[..., None], 1)))
    tiled = [rows(q, lay.dkp), rows(do.astype(q.dtype), lay.dvp), *stats]
    k_rows, v_rows = _key_rows(k, lay, lay.dkp), _key_rows(v, lay, lay.dvp)
    kr = k_rows.shape[2]
    shapes = {"dq": out_struct((lay.B, lay.nt * lay.tb, lay.H, lay.G, lay.dkp), q.dtype, q),
              "dk": out_struct((lay.B, lay.H, kr, lay.dkp), jnp.float32, q),
              "dv": out_struct((lay.B, lay.H, kr, lay.dvp), jnp.float32, q)}
    grads = {}
    for outputs in passes:
        name = "selected_resident_backward" + ("" if len(passes) == 1 else "_" + "_".join(outputs))
        kernel = functools.partial(_resident_bwd_kernel, outputs=outputs)
        grads |= zip(outputs, _resident_call(kernel, lay, table, tiled, k_rows, v_rows, [shapes[g] for g in outputs],
                                             computes=outputs, q=q, scale=scale, interpret=interpret, name=name))
    blocks = lambda x: x[:, :, :lay.num_rows * lay.br].reshape(lay.B * lay.H * lay.num_rows, lay.br, x.shape[3])
    dk = per_key_row(blocks(grads["dk"]), k.shape, cu_seqlens, block_size=block_size) * scale
    dv = per_key_row(blocks(grads["dv"]), v.shape, cu_seqlens, block_size=block_size)
    return _from_token_rows(grads["dq"], lay, q.shape[3]), dk.astype(k.dtype), dv.astype(v.dtype)
