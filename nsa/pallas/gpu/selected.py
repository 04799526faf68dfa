"""Selected attention (the fine-grained branch) as Pallas Mosaic GPU kernels: forward, dq and a deterministic dk/dv.

The contract is nsa.reference.selected's, and the index work is nsa._plan's, as for the TPU kernels
(../tpu/selected.py): each slot names its block by the block's first global key row (`block_names`),
and each tile of TB tokens gets the union of the blocks its tokens list (`tile_unions`). dk/dv inverts the
selection per token instead (`token_lists`): one list of (token, times) entries per block row, cut into
segments (`segments`), so that a step computes the TB * GR rows of TB tokens that all list its block.

Tiles. A tile is TB consecutive query tokens of one KV head with their G query heads: 64 rows (wgmma's M),
row j * GR + g for token j and head g, the heads padded to GR = the next power of 2 >= max(G, 8) (so that
TB = 64 / GR tokens fill it; G > 64 takes GR = G rounded up to 64 and TB = 1). q, do and o are kept as
[B, Tp, H, GR, Dp] (Tp = T padded to a multiple of TB, Dp = D padded to 128 bytes): a free reshape of
[B, T, HQ, D] when G = GR and nothing is padded, as at the standard shape (G = 16, D = 128); lse and delta
for the forward and dq as [B, H, NT, TB * GR] float32 (`_tile_vector`: a tile's rows contiguous, one TMA copy of
at least 256 bytes: TMA wants 128-byte-aligned shared memory, which per-token slices of GR floats are not), for
dk/dv gathered into entry order, [(E + TB) * GR] (`_entry_vector`). A tile's q, do and o rows come as TB TMA
copies of one token's [GR, Dp] each (1 KiB or more: aligned).

Keys. A block is copied whole into one [BK, Dp] shared-memory tile, BK = block_size rounded up to 64 (at
most 256: one TMA copy), from its source row of k [B, rows, H, Dkp] and v: its own first row when blocks
start on 8-row boundaries (no cu_seqlens and block_size a multiple of 8: k itself, no copy), else the
blocks laid out one every BK rows (`_block_rows`, a copy of k and v). Rows of the tile past the block
are masked; a block's rows past the last token of the tile that lists it (`last`) are zeroed in shared
memory before p v or ds k: a KV cache's rows past its sequence may hold NaN, and 0 * NaN is NaN.

Forward (`_forward_kernel`), grid (NT, H, B): a program owns a tile and walks its union (count, then per
block: its name, its source row, and `times`: 4 bits per token, or 8 when S >= 16 (then a tile has at most
4 tokens), how many of the token's slots list it), double-buffered (the next block's copies are in flight
while this one is computed). Row (j, g) sees key x + c
of block x iff token j lists it (m > 0 times: log m is added to its logits, so a block listed twice weighs
twice), c < block_size and x + c <= the token's key row t0 + j. Online softmax in base 2, float32.

Backward. delta = sum(o * do) in XLA. `_dq_kernel` walks the forward's tiles and unions, recomputing p from lse.
dk/dv: each of the B * T * H * S slots is keyed by its list (b * H + h) * NR + block row, a token's slots naming one
block merged into one entry (times = how many), and all stably sorted: list i is the entries
offsets[i] : offsets[i + 1] (E = B * T * H * min(S, NR) bounds them), its tokens increasing, and is cut into
segments of at most L = `Config.segment` entries. `_dkdv_kernel`, grid (NSEG,), owns a segment of one block's list:
it copies the block once, then walks its entries TB at a time (double-buffered): step e takes entries lo + e * TB +
j (j < TB), one TMA copy per token of q [GR, Dkp] and do [GR, Dvp] into rows j * GR ..., and one copy each of the TB
* GR floats of lse and delta at (lo + e * TB) * GR (the entry order of `_entry_vector`: TMA needs aligned shared
memory, not an aligned global offset). Row (j, g) sees key x + c iff c < block_size and x + c <= the key row of
entry j's token (log m added to its logits); in a segment's last step the rows of entries past the segment see
nothing (their tokens, those of the next entries or of the tables' padding, are still valid rows to copy). k and v
are not zeroed: a NaN key row (a cache's past its sequence) is masked for every row, and reaches only its own row of
s^T and dp^T, which the jnp.where set to 0 in p^T and ds^T. The kernel writes float32 partial dk and dv [BK, Dp] of
its block; `_reduce_kernel`, grid (NL,), adds a list's partials in segment order; XLA gathers each key row's sum. No
atomics, a fixed order: dk and dv are bitwise repeatable.

Shared memory per program (the largest, dq): q, do [64, Dp], two k and two v [BK, Dp] buffers, small vectors:
80 KiB at Dk = Dv = 128, block 64, bfloat16. Global memory: dk/dv's tables take E * (8 + 8 * GR) bytes (the
entries; lse and delta in entry order), 544 MiB at T = 64k on the standard shape (H = 4, S = 16, GR = 16), beside
the float32 partials, (NL + E / L) x [BK, Dkp + Dvp].
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nsa._config import Shapes, positive, validated, wanted
from nsa._device import facts
from nsa._plan import (PAST, Tiling, block_names, check_selected, kernel_delta, key_blocks, padded, per_key_row,
                       row_offsets, segments, tile_names, tile_starts, tile_unions, token_lists,
                       union_share)
from nsa._varlen import round_up, tokens
from nsa.pallas._batch import per_sequence
from nsa.pallas.gpu._common import (COLS, LN2, LOG2E, ROWS, by_row, call, check_dtype, iota, kernel_name,
                                    key_gradients, matmul, matmul_add, padded_dim, pipelined, smem_tile, store,
                                    tma_rows, tokens_at_once, zero_rows_past)

ROWS_PER_TILE = 64  # wgmma's M
MAX_BLOCK = 256  # the rows of one TMA copy
MAX_SLOTS = 255  # S at most: `times` counts up to 255 listings of a block by one token


@validated
class Config(NamedTuple):
    """L = segment: the most entries (tokens) of one dk/dv segment; the float32 partials are (NL + E / L) x
    [BK, Dp]."""

    segment: int = 1024

    def check(self):
        positive(self, "segment")


def default_config(shapes: Shapes, dtype, device) -> Config:
    """The Config of q [B, T, HQ, Dk] against k [B, TK, H, Dk] (`Shapes.of(q, k, v, block_size=...,
    block_counts=S)`) in `dtype` on `device`: Config()'s segments of 1024 entries at every shape, those of the
    recorded H200 run (selected attention at T = 65536: benchmarks/results/ops-65536-pallas.json)."""
    del shapes, dtype, device
    return Config()


def _head_rows(G):
    """GR: the rows of one token's heads in a tile."""
    if G > ROWS_PER_TILE:
        return round_up(G, ROWS_PER_TILE)
    return max(8, 1 << (G - 1).bit_length())


class _Layout(Tiling):
    """The static sizes of one call (see the module docstring): nsa._plan.Tiling's for tiles of TB = 64 / GR
    tokens, and GR, TB * GR rows, the bits of `times`, BK, Dkp, Dvp, whether the blocks are read from k and v
    themselves (else from `_block_rows`), and L."""

    def __init__(self, q, k, v, block_indices, block_size, cu_seqlens, kv_lens, config):
        G, S = q.shape[2] // k.shape[2], block_indices.shape[3]
        self.bits = 4 if S < 16 else 8  # per token in `times`: 4 (counts to 15), else 8 (to 255; then TB <= 4)
        self.gr = _head_rows(G) if self.bits == 4 else max(16, _head_rows(G))  # 8 bits: at most 4 tokens per tile
        super().__init__(q, k, block_indices, block_size, cu_seqlens, max(1, ROWS_PER_TILE // self.gr))
        self.rows = self.tb * self.gr
        self.bk = round_up(block_size, 64)
        self.dkp, self.dvp = padded_dim(q.shape[3], q.dtype), padded_dim(v.shape[3], v.dtype)
        self.direct = cu_seqlens is None and block_size % 8 == 0
        self.segment = config.segment


# implementation=None runs this forward instead of Triton's where a tile's union holds at most this share of the
# blocks its tokens list (`packs`). This kernel loads each distinct block of a tile of 4 tokens once for all their
# 64 rows, Triton's loads each token's blocks for its 16 rows: on the H200 at the standard shape, T = 64k, this
# forward took 0.41 ms per distinct block per 4 tokens (10.35 ms at 25.4 of the 64 slots, 20.1 at 50.3, 23.5 at
# 57.8), Triton's 16.5-17.0 ms at every union size; they break even at 0.64 of the slots (0.71 at T = 8k:
# benchmarks/results/gpu-locality.md).
PACKED = 0.6
# the same for this dq kernel against Triton's, whose dk and dv run either way (`packs_dq`): on the H200 Triton's dq
# took 18.1-18.4 ms at T = 64k on every selection, this one 0.52 ms per distinct block per 4 tokens (13.2 ms at 25.4
# of the 64 slots, 25.8 at 50.3, 30.0 at 57.8); at 16k 4.6-4.7 against 3.15 at 22.1, 5.36 at 42.4; at 8k 2.6-2.7
# against 1.66 at 19.9, 2.52 at 35.3 (benchmarks/results/packing-dq-8192-16384-65536.json): break-even near 0.5
PACKED_DQ = 0.5
# ... and only on calls of at least this many tokens (B * T): the backward's lax.cond costs 1-2 ms of its own at
# every T (1.1-1.3 at 8k-32k, 1.7 at 64k: the time the GPU waits, not a kernel's). Against the forward's claim
# alone, claiming dq too saved 3.5 ms at 64k on local selections and lost 1.5 on iid ones; at 32k +1.2 and -1.3,
# at 16k +0.2 and -1.1 (benchmarks/results/claims-65536-8192.json, claims-32768-16384.json)
MIN_DQ_TOKENS = 65536


def packs(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens=None, *, block_size, scale):
    """Whether this forward outruns Triton's on these arguments (`forward`'s): a traced bool, True where the
    tiles' unions hold at most PACKED of the blocks their tokens list (nsa._plan.union_share); False (static)
    for the queries of a KV cache (kv_lens), whose few queries per step Triton's decode kernels run. Its claim
    on implementation=None's choice (nsa.pallas.gpu.CLAIMS)."""
    del scale
    return _packs(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, block_size, PACKED, vectors=1)


def packs_dq(residuals, do, *, block_size, scale):
    """`packs` for the backward: whether this dq kernel outruns Triton's on `forward`'s residuals (at most
    PACKED_DQ of the blocks in the tiles' unions; the dq kernel's shared memory), on calls of MIN_DQ_TOKENS tokens
    or more (a static False below). Its claim on dq alone (nsa.pallas.gpu.CLAIMS): Triton's dk and dv run either
    way."""
    del do, scale
    q, k, v, block_indices, block_counts, cu_seqlens, kv_lens = residuals[:7]
    if tokens_at_once(q) < MIN_DQ_TOKENS:
        return False
    return _packs(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, block_size, PACKED_DQ, vectors=2)


def _packs(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, block_size, most, *, vectors):
    """Whether the tiles' unions hold at most `most` of the blocks their tokens list (traced), or a static False:
    a KV cache's queries, arguments this family's kernels refuse (Triton's run them, or raise their own error),
    or a kernel with `vectors` float32 row vectors whose shared memory (`_shared_memory`) exceeds the device's."""
    if kv_lens is not None:
        return False
    try:
        _check(q, k, block_indices, block_size)
    except (TypeError, ValueError):
        return False
    L = _Layout(q, k, v, block_indices, block_size, cu_seqlens, None, Config())
    if _shared_memory(L, q.dtype.itemsize, vectors) > facts("cuda").shared_memory:
        return False
    names = block_names(block_indices, block_counts, cu_seqlens, None, block_size=block_size)
    return union_share(tile_names(names, L.tb)) <= most


def _shared_memory(L, itemsize, vectors):
    """The bytes of shared memory of one forward or dq program (barriers aside): a [TB * GR, Dkp] and a
    [TB * GR, Dvp] tile (q and o; q and do), two k and two v buffers [BK, Dp], and `vectors` float32 vectors of
    the rows (the forward's lse; dq's lse and delta)."""
    return itemsize * (L.rows + 2 * L.bk) * (L.dkp + L.dvp) + 4 * vectors * L.rows


def _check(q, k, block_indices, block_size):
    check_selected(q, k, block_indices, block_size)
    check_dtype(q.dtype, "q")
    if block_indices.shape[3] > MAX_SLOTS:
        raise ValueError(f"block_indices: expected at most {MAX_SLOTS} slots per query (S; the Mosaic GPU kernels "
                         f"count a token's listings of a block in 8 bits), got S = {block_indices.shape[3]}")
    if int(block_size) > MAX_BLOCK:
        raise ValueError(f"block_size: expected at most {MAX_BLOCK} (the Mosaic GPU kernels copy a block in one TMA "
                         f"copy), got {block_size}")


def _token_rows(x, L, d, fill=0.0):
    """[B, T, HQ, ...] -> [B, Tp, H, GR, ...] (the trailing dim, if any, zero-padded to d; the padded heads and
    tokens filled with `fill`)."""
    x = x.reshape((L.B, L.T, L.H, L.G) + x.shape[3:])
    if x.ndim == 5:
        x = padded(x, 4, d)
    pads = [(0, 0), (0, L.nt * L.tb - L.T), (0, 0), (0, L.gr - L.G)] + [(0, 0)] * (x.ndim - 4)
    return x if not any(p for _, p in pads) else jnp.pad(x, pads, constant_values=fill)


def _from_token_rows(x, L, d):
    """[B, Tp, H, GR, ...] -> [B, T, HQ, ...] (the trailing dim cut to d)."""
    x = x[:, :L.T, :, :L.G]
    if x.ndim == 5:
        x = x[..., :d]
    return x.reshape((L.B, L.T, L.H * L.G) + x.shape[4:])


def _tile_vector(x, L, fill):
    """[B, T, HQ] -> [B, H, NT, TB * GR] float32 (a tile's rows, contiguous: one TMA copy), padded with `fill`."""
    x = _token_rows(x.astype(jnp.float32), L, None, fill=fill).reshape(L.B, L.nt, L.tb, L.H, L.gr)
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(L.B, L.H, L.nt, L.rows)


def _from_tile_vector(x, L):
    """`_tile_vector`'s inverse: [B, H, NT, TB * GR] -> [B, T, HQ]."""
    x = jnp.transpose(x.reshape(L.B, L.H, L.nt, L.tb, L.gr), (0, 2, 3, 1, 4))
    return _from_token_rows(x.reshape(L.B, L.nt * L.tb, L.H, L.gr), L, None)


def _block_rows(x, L, cu_seqlens, block_size, d):
    """[B, TK, H, D] -> [B, NR * BK, H, d]: block row r of each (b, h) at rows r * BK, zero-padded (for
    blocks that do not start on 8-row boundaries: packed sequences, or a block_size not a multiple of 8)."""
    keys = tokens(L.TK, block_size, cu_seqlens)
    dest = key_blocks(keys, block_size) * L.bk + keys.pos[0] % block_size  # [TK], unique
    out = jnp.zeros((L.B, L.num_rows * L.bk, L.H, d), x.dtype)
    return out.at[:, dest].set(padded(x, 3, d), unique_indices=True)


def _source_rows(names, L, cu_seqlens, block_size):
    """The row of the kernels' k each block named `names` (a first key row; PAST for none) is copied from."""
    if L.direct:
        return names
    keys = tokens(L.TK, block_size, cu_seqlens)
    x = jnp.where(names == PAST, 0, names)
    return key_blocks(keys, block_size, x) * L.bk


def _times(tile_names, union, bits):
    """int32 [B, H, NT, U]: per union block, `bits` bits per token j of the tile (at bit bits * j): how many of
    its S slots name the block (S < 2 ** bits: exact)."""
    listed = jnp.sum(tile_names[:, :, :, None, :, :] == union[..., None, None], axis=-1)  # [B, H, NT, U, TB]
    shifts = bits * jnp.arange(listed.shape[-1], dtype=jnp.int32)
    return jnp.sum(listed.astype(jnp.int32) << shifts, axis=-1).astype(jnp.int32)  # disjoint fields: an OR


def _tables(block_indices, block_counts, cu_seqlens, kv_lens, L, block_size):
    """What the forward and dq kernels read per tile: (count [B, H, NT], t0 [B, H, NT], union [B, H, NT, U], the
    source rows, times and last [B, H, NT, U]: the key row of the last token of the tile that lists each block;
    rows past it are zeroed when copied, as no token of the tile sees them)."""
    offsets = row_offsets(kv_lens, L.T)
    names = tile_names(block_names(block_indices, block_counts, cu_seqlens, kv_lens, block_size=block_size), L.tb)
    union, last, count = tile_unions(names, offsets, L.union)
    return (count, tile_starts(offsets, (L.B, L.H, L.nt), L.tb), union, _source_rows(union, L, cu_seqlens, block_size),
            _times(names, union, L.bits), last)


def _block_mask(shape, x, t0, times, *, gr, bits, block_size, key_dim):
    """bool [shape] of a (rows, keys) tile (key_dim 1) or its transpose (key_dim 0) against block x: token j =
    row // GR lists it (its `times` bits), the key x + c is in the block (c < block_size) and at or before
    the token's key row t0 + j. Also returns log(times) per entry (0 where unlisted), float32."""
    c = iota(shape, key_dim)
    j = lax.div(iota(shape, 1 - key_dim), jnp.int32(gr))
    m = lax.shift_right_logical(jnp.full(shape, times, jnp.int32), bits * j) & ((1 << bits) - 1)
    visible = (m > 0) & (c < block_size) & (x + c <= t0 + j)
    return visible, jnp.log2(jnp.maximum(m, 1).astype(jnp.float32))


def _copy_tile_rows(src, dst, b, h, first_token, barrier, *, tb, gr):
    """Tokens first_token ... + TB - 1 of src [B, Tp, H, GR, ...] at (b, h) into dst ([TB * GR, ...] shared
    memory): one TMA copy per token, each an arrival on `barrier` (made for that many arrivals)."""
    for j in range(tb):
        plgpu.copy_gmem_to_smem(src.at[b, first_token + j, h], dst.at[pl.ds(j * gr, gr)], barrier)


def _tile_barriers(copies, num_barriers=1):
    """TMA barriers that complete after `copies` tile copies of TB tokens each (`_copy_tile_rows`)."""
    return plgpu.Barrier(num_arrivals=copies, num_barriers=num_barriers)


def _forward_kernel(count_ref, t0_ref, union_ref, source_ref, times_ref, last_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                    q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, *, L, block_size, scale):
    i, h, b = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("batch")
    tb, gr = L.tb, L.gr
    tokens_of_tile = i * tb
    _copy_tile_rows(q_ref, q_smem, b, h, tokens_of_tile, q_bar.at[0], tb=tb, gr=gr)
    n, t0 = count_ref[b, h, i], t0_ref[b, h, i]
    plgpu.barrier_wait(q_bar.at[0])

    def fetch(u, slot):
        rows = pl.ds(pl.multiple_of(source_ref[b, h, i, u], 8), L.bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_smem.at[slot], v_bar.at[slot])

    def step(u, slot, carry):
        acc, m, l = carry
        x = union_ref[b, h, i, u]
        plgpu.barrier_wait(k_bar.at[slot])
        logits = matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (L.rows, L.bk)) * (scale * LOG2E)
        visible, log_times = _block_mask(logits.shape, x, t0, times_ref[b, h, i, u], gr=gr, bits=L.bits,
                                         block_size=block_size, key_dim=1)
        logits = jnp.where(visible, logits + log_times, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(logits - by_row(m_use, logits.shape))
        l = l * alpha + p.sum(axis=1)
        acc = acc * by_row(alpha, acc.shape)
        plgpu.barrier_wait(v_bar.at[slot])
        zero_rows_past(v_smem.at[slot], x, last_ref[b, h, i, u])
        return matmul_add(acc, p.astype(q_smem.dtype), v_smem.at[slot]), m_new, l

    init = (plgpu.layout_cast(jnp.zeros((L.rows, L.dvp), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((L.rows,), -jnp.inf, jnp.float32), ROWS),
            plgpu.layout_cast(jnp.zeros((L.rows,), jnp.float32), ROWS))
    acc, m, l = pipelined(n, fetch, step, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_smem[...] = (acc / by_row(l_safe, acc.shape)).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
    plgpu.commit_smem()
    for j in range(tb):
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(j * gr, gr)], o_ref.at[b, tokens_of_tile + j, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, i])
    plgpu.wait_smem_to_gmem(0)


def _dq_kernel(count_ref, t0_ref, union_ref, source_ref, times_ref, last_ref, q_ref, do_ref, lse_ref, delta_ref,
               k_ref, v_ref, dq_ref, q_smem, do_smem, stats, k_smem, v_smem, q_bar, k_bar, v_bar, *, L, block_size,
               scale):
    i, h, b = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("batch")
    tb, gr = L.tb, L.gr
    tokens_of_tile = i * tb
    for src, dst in ((q_ref, q_smem), (do_ref, do_smem)):
        _copy_tile_rows(src, dst, b, h, tokens_of_tile, q_bar.at[0], tb=tb, gr=gr)
    for j, src in enumerate((lse_ref, delta_ref)):
        plgpu.copy_gmem_to_smem(src.at[b, h, i], stats.at[j], q_bar.at[0])
    n, t0 = count_ref[b, h, i], t0_ref[b, h, i]
    plgpu.barrier_wait(q_bar.at[0])
    lse = plgpu.load(stats.at[0], layout=ROWS)
    delta = plgpu.load(stats.at[1], layout=ROWS)
    seen = lse > -jnp.inf
    lse2 = jnp.where(seen, lse * LOG2E, 0.0)

    def fetch(u, slot):
        rows = pl.ds(pl.multiple_of(source_ref[b, h, i, u], 8), L.bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_smem.at[slot], v_bar.at[slot])

    def step(u, slot, acc):
        x = union_ref[b, h, i, u]
        plgpu.barrier_wait(k_bar.at[slot])
        zero_rows_past(k_smem.at[slot], x, last_ref[b, h, i, u])
        logits = matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (L.rows, L.bk)) * (scale * LOG2E)
        shape = logits.shape
        visible, log_times = _block_mask(shape, x, t0, times_ref[b, h, i, u], gr=gr, bits=L.bits, block_size=block_size,
                                         key_dim=1)
        visible = visible & by_row(seen, shape)
        p = jnp.where(visible, jnp.exp2(logits + log_times - by_row(lse2, shape)), 0.0)
        plgpu.barrier_wait(v_bar.at[slot])
        dp = matmul(do_smem, v_smem.at[slot].transpose((1, 0)), shape)
        ds = jnp.where(visible, p * (dp - by_row(delta, shape)), 0.0)
        return matmul_add(acc, ds.astype(q_smem.dtype), k_smem.at[slot])

    acc = pipelined(n, fetch, step, plgpu.layout_cast(jnp.zeros((L.rows, L.dkp), jnp.float32),
                                                      plgpu.Layout.WGMMA))
    q_smem[...] = (acc * scale).astype(q_smem.dtype)
    plgpu.commit_smem()
    for j in range(tb):
        plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(j * gr, gr)], dq_ref.at[b, tokens_of_tile + j, h])
    plgpu.wait_smem_to_gmem(0)


def _token_mask(shape, limits, counts, *, gr, block_size):
    """bool [shape] of a (keys, rows) tile of the dk/dv kernel against its block: key c (the block's row c) is
    visible to row r iff c < block_size and c <= limits[r // GR] (the key row of the row's token less the block's
    first row; -1 for a row of no token). Also returns log2(counts[r // GR]) per entry (0 where counts is 0),
    float32. limits, counts: TB scalars each, made per row by a chain of selects on the row's token r // GR."""
    j = lax.div(iota(shape, 1), jnp.int32(gr))
    limit, count = jnp.full(shape, limits[-1], jnp.int32), jnp.full(shape, counts[-1], jnp.int32)
    for t in range(len(limits) - 2, -1, -1):
        limit = jnp.where(j == t, jnp.full(shape, limits[t], jnp.int32), limit)
        count = jnp.where(j == t, jnp.full(shape, counts[t], jnp.int32), count)
    c = iota(shape, 0)
    return (c < block_size) & (c <= limit), jnp.log2(jnp.maximum(count, 1).astype(jnp.float32))


def _dkdv_kernel(seg_ref, entry_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem,
                 q_smem, do_smem, stats, k_bar, q_bar, *, L, block_size, scale):
    """A segment: seg_ref [NSEG, 7] (b, h, the block's name x, its source row, the entries lo, hi, the key row
    offset of batch row b); entry_ref [E + TB, 2] (the entry's token, times); lse_ref, delta_ref [(E + TB) * GR]
    (`_entry_vector`). Step e takes entries lo + e * TB + j, j < TB: row j * GR + g is head g of entry j's token.
    Entries at or past hi (in a segment's last step) are read (every row of entry_ref names a token < T: valid
    memory to copy) but their rows see nothing."""
    s = lax.axis_index("segment")
    b, h, x, source, lo, hi, offset = (seg_ref[s, c] for c in range(7))
    tb, gr = L.tb, L.gr
    rows = pl.ds(pl.multiple_of(source, 8), L.bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_smem, k_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_smem, k_bar.at[1])

    def fetch(e, slot):  # 2 * TB + 2 copies, all on q_bar[slot]
        first = lo + e * tb
        for j in range(tb):
            token = entry_ref[first + j, 0]
            for src, dst in ((q_ref, q_smem.at[slot]), (do_ref, do_smem.at[slot])):
                plgpu.copy_gmem_to_smem(src.at[b, token, h], dst.at[pl.ds(j * gr, gr)], q_bar.at[slot])
        vector = pl.ds(first * gr, L.rows)  # entries first ... + TB - 1: contiguous
        for j, src in enumerate((lse_ref, delta_ref)):
            plgpu.copy_gmem_to_smem(src.at[vector], stats.at[slot, j], q_bar.at[slot])

    def step(e, slot, carry):
        dk, dv = carry
        first = lo + e * tb
        limits = [jnp.where(first + j < hi, offset + entry_ref[first + j, 0] - x, -1) for j in range(tb)]
        counts = [entry_ref[first + j, 1] for j in range(tb)]
        plgpu.barrier_wait(q_bar.at[slot])
        lse = plgpu.load(stats.at[slot, 0], layout=COLS)
        delta = plgpu.load(stats.at[slot, 1], layout=COLS)
        logits_t = matmul(k_smem, q_smem.at[slot].transpose((1, 0)), (L.bk, L.rows)) * (scale * LOG2E)
        visible, log_times = _token_mask(logits_t.shape, limits, counts, gr=gr, block_size=block_size)
        return key_gradients(dk, dv, logits_t + log_times, visible, lse, delta, q_smem.at[slot], do_smem.at[slot],
                             v_smem)

    plgpu.barrier_wait(k_bar.at[0])
    plgpu.barrier_wait(k_bar.at[1])
    zeros = lambda d: plgpu.layout_cast(jnp.zeros((L.bk, d), jnp.float32), plgpu.Layout.WGMMA)
    steps = lax.div(hi - lo + (tb - 1), tb)
    dk, dv = pipelined(steps, fetch, step, (zeros(L.dkp), zeros(L.dvp)))
    pl.run_scoped(lambda out: store(dk, out, dk_ref.at[s]), plgpu.SMEM((L.bk, L.dkp), jnp.float32))
    pl.run_scoped(lambda out: store(dv, out, dv_ref.at[s]), plgpu.SMEM((L.bk, L.dvp), jnp.float32))


def _reduce_kernel(list_ref, dk_ref, dv_ref, dk_out, dv_out, dk_smem, dv_smem, bar):
    """List l's partials (segments list_ref[l, 0] ... + list_ref[l, 1] - 1) summed in segment order."""
    l = lax.axis_index("list")
    first, n = list_ref[l, 0], list_ref[l, 1]

    def add(s, sums):
        out = []
        for src, smem, total, j in ((dk_ref, dk_smem, sums[0], 0), (dv_ref, dv_smem, sums[1], 1)):
            plgpu.copy_gmem_to_smem(src.at[first + s], smem, bar.at[j])
            plgpu.barrier_wait(bar.at[j])
            out.append(total + plgpu.load(smem, layout=plgpu.Layout.WGMMA))
        return tuple(out)

    zeros = lambda smem: plgpu.layout_cast(jnp.zeros(smem.shape, jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, n, add, (zeros(dk_smem), zeros(dv_smem)))
    store(dk, dk_smem, dk_out.at[l])
    store(dv, dv_smem, dv_out.at[l])


# ------------------------------------------------------------------------------------------ wrappers


def _keys(x, L, cu_seqlens, block_size, d):
    """What the kernels read as k or v: x itself (D padded) when its blocks start on 8-row boundaries, else
    `_block_rows`."""
    if L.direct:
        return tma_rows(padded(x, 3, d), L.bk)
    return _block_rows(x, L, cu_seqlens, block_size, d)


def _kernel(body, grid, names, outputs, scratch, *args):
    return call(body, outputs, *args, grid=grid, grid_names=names, scratch_types=scratch,
                kernel_name=kernel_name("selected", body))


def forward(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens=None, *, block_size, scale, config=None):
    """o [B, T, HQ, Dv] (q's dtype) and the residuals (q, k, v, block_indices, block_counts, cu_seqlens, kv_lens,
    o, lse [B, T, HQ] float32): ../tpu/selected.py's `forward` on Mosaic GPU (bfloat16, float16).
    config: a Config (None: `default_config`). A symbolic batch runs once per sequence (`per_sequence`: no Mosaic
    GPU grid takes one)."""
    o, lse = per_sequence(_attention)(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens,
                                      block_size=block_size, scale=scale, config=config)
    return o, (q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse)


def _config(config, q, k, v, block_indices, block_size):
    if config is not None:
        return config
    shapes = Shapes.of(q, k, v, block_size=block_size, block_counts=block_indices.shape[3])
    return default_config(shapes, q.dtype, facts("cuda"))


def _attention(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, *, block_size, scale, config):
    """`forward`'s o and lse."""
    _check(q, k, block_indices, block_size)
    L = _Layout(q, k, v, block_indices, block_size, cu_seqlens, kv_lens,
                _config(config, q, k, v, block_indices, block_size))
    tables = _tables(block_indices, block_counts, cu_seqlens, kv_lens, L, block_size)
    tile = (L.B, L.nt * L.tb, L.H, L.gr)
    o, lse_t = _kernel(
        functools.partial(_forward_kernel, L=L, block_size=block_size, scale=float(scale)), (L.nt, L.H, L.B),
        ("tile", "head", "batch"),
        (jax.ShapeDtypeStruct(tile + (L.dvp,), q.dtype),
         jax.ShapeDtypeStruct((L.B, L.H, L.nt, L.rows), jnp.float32)),
        [smem_tile((L.rows, L.dkp), q.dtype), smem_tile((2, L.bk, L.dkp), k.dtype),
         smem_tile((2, L.bk, L.dvp), v.dtype), smem_tile((L.rows, L.dvp), q.dtype),
         plgpu.SMEM((L.rows,), jnp.float32), _tile_barriers(L.tb), plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_barriers=2)],
        *tables, _token_rows(q, L, L.dkp), _keys(k, L, cu_seqlens, block_size, L.dkp),
        _keys(v, L, cu_seqlens, block_size, L.dvp))
    return _from_token_rows(o, L, v.shape[3]), _from_tile_vector(lse_t, L)


def _dkdv_tables(block_indices, block_counts, cu_seqlens, kv_lens, L, block_size):
    """The dk/dv segments and entries: (seg [NSEG, 7] int32: b, h, the block's name, its source row, the entries
    lo, hi, the key row offset of b; entries [E + TB, 2] int32: token, times, then TB rows (0, 0), so that a step
    reads TB entries from any lo + TB * step < hi in bounds; lists [NL, 2]: each list's first segment and how
    many; bh [E]: b * H + h of each entry, for `_entry_vector`)."""
    names = block_names(block_indices, block_counts, cu_seqlens, kv_lens, block_size=block_size)  # [B, T, H, S]
    offsets, bh, token, times, name = token_lists(names, cu_seqlens, num_keys=L.TK, block_size=block_size)
    if (token.shape[0] + L.tb) * L.gr >= 2 ** 31:
        raise ValueError(f"block_indices: expected B * T * H * min(S, block rows) entries whose lse and delta ({L.gr} "
                         f"each) the Mosaic GPU dk/dv kernel indexes with int32 offsets, got {token.shape[0]}")
    seg_offsets, seg_list, lo, hi = segments(offsets, token.shape[0], L.segment)
    per_b = L.H * L.num_rows
    b = seg_list // per_b
    row_offset = jnp.broadcast_to(row_offsets(kv_lens, L.T), (L.B,))  # the key row of each batch row's token 0
    seg = jnp.stack([b, seg_list % per_b // L.num_rows, name[lo], _source_rows(name[lo], L, cu_seqlens, block_size),
                     lo, hi, row_offset[b]], axis=1).astype(jnp.int32)
    entries = jnp.pad(jnp.stack([token, times], axis=1), [(0, L.tb), (0, 0)])
    lists = jnp.stack([seg_offsets[:-1], seg_offsets[1:] - seg_offsets[:-1]], axis=1).astype(jnp.int32)
    return seg, entries.astype(jnp.int32), lists, bh


def _entry_vector(x, entries, bh, L, fill):
    """[B, T, HQ] -> float32 [(E + TB) * GR]: the GR values of entry e (its token's query heads of its KV head,
    the padded heads `fill`) at e * GR, so that a dk/dv step's TB entries are TB * GR contiguous floats (one TMA copy
    into 128-byte-aligned shared memory, from any offset); the TB padding entries `fill`."""
    rows = _token_rows(x.astype(jnp.float32), L, None, fill=fill)  # [B, Tp, H, GR]
    values = rows[bh // L.H, entries[:bh.shape[0], 0], bh % L.H]  # [E, GR]
    return jnp.pad(values, [(0, L.tb), (0, 0)], constant_values=fill).reshape(-1)


@per_sequence
def backward(residuals, do, *, block_size, scale, config=None, grads=None):
    """Gradients (dq, dk, dv, None, None, None, None) in q's, k's and v's dtypes, from `forward`'s residuals and
    do [B, T, HQ, Dv]; config as for `forward`. grads: the gradients to compute, (0,) dq or (1, 2) dk and dv
    (None in their place otherwise; None: all): implementation=None takes dq alone from here where `packs_dq`
    holds."""
    q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse = residuals
    L = _Layout(q, k, v, block_indices, block_size, cu_seqlens, kv_lens,
                _config(config, q, k, v, block_indices, block_size))
    delta = kernel_delta(o, do, q.dtype)
    rows = _token_rows(q, L, L.dkp), _token_rows(do.astype(q.dtype), L, L.dvp)
    keys = _keys(k, L, cu_seqlens, block_size, L.dkp), _keys(v, L, cu_seqlens, block_size, L.dvp)
    selection = block_indices, block_counts, cu_seqlens, kv_lens
    common = dict(L=L, block_size=block_size, scale=float(scale))
    dq = dk = dv = None
    if wanted(grads, 0):
        dq = _from_token_rows(_query_gradient(rows, lse, delta, keys, selection, common), L, q.shape[3])
    if wanted(grads, 1, 2):
        dk, dv = _key_gradients(rows, lse, delta, keys, selection, common)
        dk = (per_key_row(dk, k.shape, cu_seqlens, block_size=block_size) * scale).astype(k.dtype)
        dv = per_key_row(dv, v.shape, cu_seqlens, block_size=block_size).astype(v.dtype)
    return dq, dk, dv, None, None, None, None


def _query_gradient(rows, lse, delta, keys, selection, common):
    """`backward`'s dq [B, Tp, H, GR, Dkp] (`_dq_kernel` over the forward's tiles and unions), from q and do as
    token rows, lse and delta [B, T, HQ], the kernels' k and v, and the selection (block_indices, block_counts,
    cu_seqlens, kv_lens)."""
    L = common["L"]
    q, do = rows
    tables = _tables(*selection, L, common["block_size"])
    vectors = _tile_vector(lse, L, -jnp.inf), _tile_vector(delta, L, 0.0)
    return _kernel(
        functools.partial(_dq_kernel, **common), (L.nt, L.H, L.B), ("tile", "head", "batch"),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        [smem_tile((L.rows, L.dkp), q.dtype), smem_tile((L.rows, L.dvp), q.dtype),
         plgpu.SMEM((2, L.rows), jnp.float32), smem_tile((2, L.bk, L.dkp), keys[0].dtype),
         smem_tile((2, L.bk, L.dvp), keys[1].dtype), _tile_barriers(2 * L.tb + 2),
         plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)],
        *tables, q, do, *vectors, *keys)


def _key_gradients(rows, lse, delta, keys, selection, common):
    """`backward`'s unscaled float32 dk and dv per list (block row of a (batch, KV head)) [NL, BK, Dp]: the
    selections inverted into per-block token lists, their segments' partials (`_dkdv_kernel`), the lists' sums
    (`_reduce_kernel`); arguments as `_query_gradient`'s."""
    L = common["L"]
    q, do = rows
    seg, entries, lists, bh = _dkdv_tables(*selection, L, common["block_size"])
    vectors = (_entry_vector(lse, entries, bh, L, -jnp.inf), _entry_vector(delta, entries, bh, L, 0.0))
    nseg, num_lists = seg.shape[0], lists.shape[0]
    dk_part, dv_part = _kernel(
        functools.partial(_dkdv_kernel, **common), (nseg,), ("segment",),
        (jax.ShapeDtypeStruct((nseg, L.bk, L.dkp), jnp.float32),
         jax.ShapeDtypeStruct((nseg, L.bk, L.dvp), jnp.float32)),
        [smem_tile((L.bk, L.dkp), keys[0].dtype), smem_tile((L.bk, L.dvp), keys[1].dtype),
         smem_tile((2, L.rows, L.dkp), q.dtype), smem_tile((2, L.rows, L.dvp), q.dtype),
         plgpu.SMEM((2, 2, L.rows), jnp.float32), plgpu.Barrier(num_barriers=2),
         _tile_barriers(2 * L.tb + 2, 2)],
        seg, entries, q, do, *vectors, *keys)
    return _kernel(
        _reduce_kernel, (num_lists,), ("list",),
        (jax.ShapeDtypeStruct((num_lists, L.bk, L.dkp), jnp.float32),
         jax.ShapeDtypeStruct((num_lists, L.bk, L.dvp), jnp.float32)),
        [plgpu.SMEM((L.bk, L.dkp), jnp.float32), plgpu.SMEM((L.bk, L.dvp), jnp.float32),
         plgpu.Barrier(num_barriers=2)],
        lists, dk_part, dv_part)
