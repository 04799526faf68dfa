"""Block selection (`select_blocks`) as one Triton kernel: compressed-attention scores fused with top-k.

The contract is nsa.reference.select's. Query t of KV head h, at in-sequence position p, sees the
compressed rows cmp_start <= r < cmp_start + (p + 1) // block_size; each of its G = HQ / H query heads
takes the softmax p_g(c) of scale * q_g . k_cmp over them, and block c (row cmp_start + c) scores
mean_g p_g(c). Blocks 0, p // bs - 1 and p // bs are forced (ranks 2, 3 and 4, above any score),
blocks after p // bs are never candidates; the block_counts best are kept in rank order, ties going
to the lower block id, unused slots -1. With compression windows of l tokens every d that are not the selection
blocks (CL, CD != BS), a query sees the rows of its complete windows (`_topk.complete_rows`) and block j scores
Eq. 9, the rows it overlaps (`_topk.eq9_keys`: a chunk's row scores shifted by tl.gather and summed; chunks STEP
rows apart share the l / d + l' / d - 2 rows a block's score reaches across); the decode select takes one row
per block only, and with other windows a cache's few queries run this kernel.

`_select_kernel` never materializes the [T, NC] scores. One program owns TB consecutive tokens of one
KV head and stacks their G query heads (padded to GR, a power of two) into the rows of one tile, so
every chunk of BC compressed rows is loaded once for TB tokens and tl.dot gets TB * GR rows (64; 32 in
float32). It walks the chunks twice: first for the log-sum-exp of each row (online, in base 2),
skipped when the caller gives compressed attention's lse; then to recompute the probabilities, sum
them over each token's heads and merge the chunk into each token's running top.

The running top, its merge with each chunk and its store are nsa/triton/_topk.py's, shared with the decode
select (nsa/triton/decode_select.py), which `forward` runs instead for a few queries at the end of a KV cache
(decode=None: where `nsa.triton._splits.applies`). Everything is float32 whatever the input dtype; a row's
result depends only on its own loads, so it is deterministic. Batched, packed and cached sequences take one
path: the kernel reads pos and cmp_start (nsa._varlen.tokens) per token of each batch row, and the tokens of
one tile may belong to several packed sequences (each token has its own visible rows, candidates and top).
With kv_lens (a KV cache) the T queries are the last tokens of sequences of kv_lens[b] tokens that k_cmp
covers: query t of batch row b is at position kv_lens[b] - T + t, and may have up to NB = max(ceil(T / bs),
NC) blocks; the rows of k_cmp past the visible ones (a cache's partial or unwritten blocks) are never loaded.

Layouts (contiguous): q [B, T, HQ, Dk], k_cmp [B, NC, H, Dk], lse [B, T, HQ] float32, pos and cmp_start
[B, T] int32, out [B, T, H, S] int32; query head hq uses KV head hq // G. Token offsets are computed in
int64 (b * T + t can be multiplied past 2^31).
"""

from typing import NamedTuple

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa._config import Shapes, positive, power_of_two, validated
from nsa._plan import blocks_of, one_row_per_block
from nsa._varlen import cdiv, tokens
from nsa.reference.select import unless_one_row_per_block
from nsa.triton import _launch, _splits, _topk, decode_select
from nsa.triton import decode as flash_decoding
from nsa.triton._common import LOG2E, check, device, sequence_rows
from nsa.triton._topk import complete_rows, eq9_keys, eq9_step, keys, logits, merge_top, store_top

_ROWS = 64  # query rows per tile (TB tokens x GR heads): the M of one wgmma
_ROWS_FP32 = 32  # float32 takes no wgmma (IEEE products: an FMA dot), and spills less with fewer rows

# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _select_kernel(q, k_cmp, lse, pos, cmp_start, out,
                   T: tl.constexpr, NC: tl.constexpr, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                   BS: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr, TB: tl.constexpr,
                   DKP: tl.constexpr, BC: tl.constexpr, SP: tl.constexpr, IEEE: tl.constexpr,
                   HAS_LSE: tl.constexpr, CL: tl.constexpr, CD: tl.constexpr, STEP: tl.constexpr):
    """The top-S blocks of TB consecutive tokens of one KV head.

    Grid: (cdiv(T, TB), B * H). Tile: M = TB * GR query rows, row i = token t0 + i // GR, head
    h * G + i % GR (heads >= G and tokens >= T masked), against BC compressed rows at a time.
    Loads q [B, T, HQ, DK] once (M x DKP), pos and cmp_start [B, T] (int32) of batch row b per token and
    per row, lse [B, T, HQ] (M rows, when HAS_LSE), then the key chunks k_cmp [B, NC, H, DK] (DKP x BC).
    The chunks walk the rows of k_cmp from the tile's lowest cmp_start, and load the rows below the
    tile's last visible one (vis_end, at most NC): rows past it are never read (a cache's partial or
    unwritten blocks); the partial last block of a packed sequence may be loaded when the tile holds the
    next sequence's tokens, but no query uses it.
    Without HAS_LSE a first pass up to vis_end computes the lse of each query row; the second pass up
    to the last candidate block (the current block may be one past the visible rows) sums the
    probabilities over each token's heads ([M, BC] -> [TB, GR, BC]) and merges the chunk into the
    running top of each token ([TB, SP] keys, SP = S padded to a power of two >= 2, SP <= BC), unless
    no key can enter any token's top-S.
    Stores out [B, T, H, S] int32: block ids in rank order, -1 in unused slots.
    """
    t0 = tl.program_id(0) * TB
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    M: tl.constexpr = TB * GR

    pos += b * T  # this batch row's tokens
    cmp_start += b * T

    # each token of the tile [TB]: its sequence's first compressed row, visible rows and current block
    tok = t0 + tl.arange(0, TB)
    tok_ok = tok < T
    p_tok = tl.load(pos + tok, mask=tok_ok, other=0)
    first = tl.load(cmp_start + tok, mask=tok_ok, other=0)
    n_vis = tl.where(tok_ok, complete_rows(p_tok, BS=BS, CL=CL, CD=CD), 0)
    cur = tl.where(tok_ok, p_tok // BS, -1)  # padded tokens have no candidates

    # each query row of the tile [M]: its token's visible rows [first_row, end_row) of k_cmp (none past its
    # last row: under jit a cu_seqlens can ask for more rows than a given k_cmp holds)
    i = tl.arange(0, M)
    t_row = t0 + i // GR
    hq = h * G + i % GR
    row_ok = (i % GR < G) & (t_row < T)
    first_row = tl.load(cmp_start + t_row, mask=row_ok, other=0)
    p_row = tl.load(pos + t_row, mask=row_ok, other=0)
    end_row = tl.where(row_ok, first_row + complete_rows(p_row, BS=BS, CL=CL, CD=CD), first_row)
    end_row = tl.minimum(end_row, NC)
    q_row = (b * T + t_row) * (H * G) + hq  # int64 row of q and lse
    dk = tl.arange(0, DKP)
    q_tile = tl.load(q + q_row[:, None] * DK + dk[None, :], mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)

    c = tl.arange(0, BC)
    # the chunks walk k_cmp from the tile's lowest cmp_start; no token of the tile sees a row >= vis_end
    lo = tl.min(tl.where(tok_ok, first, NC), 0)
    vis_end = tl.minimum(tl.max(first + n_vis, 0), NC)
    if HAS_LSE:
        lse_row = tl.load(lse + q_row, mask=row_ok, other=float("-inf"))
        seen = lse_row > float("-inf")  # rows that see no compressed row get p = 0, never NaN
        lse2 = tl.where(seen, lse_row * LOG2E, 0.0)
    else:
        # pass 1: lse (base 2) of each row over its visible rows
        m = tl.full([M], float("-inf"), tl.float32)
        l_sum = tl.zeros([M], tl.float32)
        for r0 in range(lo, vis_end, BC):
            rows = r0 + c
            load = rows < vis_end
            s = logits(q_tile, k_cmp, sequence_rows(b, rows, load, h, NK=NC, H=H), load, DK=DK, DKP=DKP, SCALE=SCALE,
                       IEEE=IEEE)
            s = tl.where((rows[None, :] >= first_row[:, None]) & (rows[None, :] < end_row[:, None]), s,
                         float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
            l_sum = l_sum * tl.exp2(m - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
            m = m_new
        seen = l_sum > 0
        lse2 = tl.where(seen, m + tl.log2(tl.where(seen, l_sum, 1.0)), 0.0)

    # pass 2: scores of each token's candidates, merged chunk by chunk into its running top
    top = tl.full([TB, SP], -1, tl.int64)  # keys in ascending order: slot SP - 1 ranks first
    ONE_ROW: tl.constexpr = CL == BS and CD == BS
    if ONE_ROW:
        start = lo
        end = tl.max(first + cur, 0) + 1
    else:  # chunks STEP rows apart, from UR - 1 rows before the first (`eq9_keys`)
        start = lo - (CL // CD - 1)
        end = tl.max(first + (BS // CD) * cur, 0) + 1
    for r0 in range(start, end, STEP):
        rows = r0 + c
        load = (rows >= 0) & (rows < vis_end)
        s = logits(q_tile, k_cmp, sequence_rows(b, rows, load, h, NK=NC, H=H), load, DK=DK, DKP=DKP, SCALE=SCALE,
                   IEEE=IEEE)
        vis = (rows[None, :] >= first_row[:, None]) & (rows[None, :] < end_row[:, None]) & seen[:, None]
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        score = tl.sum(tl.reshape(p, [TB, GR, BC]), 1) / G
        if ONE_ROW:
            key = keys(score, rows[None, :] - first[:, None], cur)  # [TB, BC], by in-sequence block id
        else:
            key = eq9_keys(score, rows, first, cur, BC=BC, BS=BS, CL=CL, CD=CD)
        top = merge_top(top, key, S=S, SP=SP)

    store_top(out, (b * T + tok) * H + h, top, tok_ok, S=S, SP=SP)


# ------------------------------------------------------------------------------------ wrappers


@validated
class Config(NamedTuple):
    """The launch of the select kernel: TB query tokens per program, BC compressed rows per step, warps
    and pipeline stages."""

    tokens: int
    chunk: int
    num_warps: int
    num_stages: int

    def check(self):
        power_of_two(self, "tokens", "chunk", "num_warps")
        positive(self, "num_stages")


def _sizes(shapes, cached):
    """(NB, the most blocks a query can have; nsa.triton._topk.sizes) of the queries against k_cmp (TK = NC),
    at the end of a KV cache's sequences where cached."""
    blocks = _topk.num_blocks(shapes.T, shapes.TK, shapes.block_size, cached, shapes.compress_stride or None)
    return blocks, _topk.sizes(shapes.G, shapes.Dk, shapes.block_counts, blocks)


def default_config(shapes, dtype, device):
    """The Config for q [B, T, HQ, Dk] against k_cmp [B, NC, H, Dk]: `nsa._config.Shapes.of(q, k_cmp,
    block_size=..., block_counts=S, packed=..., compress_block_size=..., compress_stride=...)` (TK = NC; packed
    sequences have the blocks of T tokens at most, the others those of the longest sequence k_cmp covers, as with
    a KV cache).

    TB tokens per tile so that their heads, G padded to GR = a power of two, fill TB * GR = 64 rows, 32
    in float32 (one token when G is larger; fewer for a short T, never under tl.dot's 16 rows). BC = 64
    compressed rows per step, fewer (>= 16) when there are fewer blocks, at least SP (tl.topk takes SP of
    them). Eight warps when a tile passes 16 KiB: q [M, DKP], the key chunk [DKP, BC] (itemsize bytes
    each), the float32 logits [M, BC] or the int64 keys [TB, BC]. Two pipeline stages (the next key chunk
    loads while this one is scored) once a tile walks four chunks or more, else one: two stages were faster
    at T = 65536 (1024 blocks) and slower at T = 8192 (128 blocks, about one chunk: more shared memory,
    fewer resident programs, nothing to overlap), benchmarks/results/ops-pipelining-ab.json.

    With windows that are not the selection blocks (Eq. 9) a chunk's rows are the compressed rows, l' / d per
    block, and two chunks share l / d + l' / d - 2 of them (`_topk.eq9_keys`): BC is sized by the rows and holds at
    least four times those, so that a chunk moves on by three quarters of its rows or more. Not yet timed.
    """
    blocks, sized = _sizes(shapes, cached=not shapes.packed)
    itemsize = jnp.dtype(dtype).itemsize
    gr, dkp = sized["GR"], sized["DKP"]
    tb = max(16 // gr, min(max(1, (_ROWS_FP32 if itemsize == 4 else _ROWS) // gr), triton.next_power_of_2(shapes.T)))
    rows = blocks
    bc = _topk.chunk(sized["SP"], blocks)
    if not shapes.one_row_per_block:
        rows = blocks * shapes.block_size // shapes.compress_stride
        shared = (shapes.compress_block_size + shapes.block_size) // shapes.compress_stride - 2
        bc = max(_topk.chunk(sized["SP"], rows), triton.next_power_of_2(4 * shared))
    largest = max(tb * gr * dkp * itemsize, dkp * bc * itemsize, tb * gr * bc * 4, tb * bc * 8)
    return Config(tb, bc, 8 if largest > 16384 else 4, 2 if rows >= 4 * bc else 1)


def sums_eq9(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_size, compress_block_size=None, compress_stride=None,
             **static):
    """Whether this kernel outruns Mosaic GPU's select (nsa.pallas.gpu.select, which implementation=None prefers on
    CUDA) on `forward`'s arguments: a static True where a selection block scores several compressed rows (Eq. 9:
    windows that are not the blocks themselves, such as the paper's l = 32 every d = 16), a static False where each
    block is one row. This kernel sums Eq. 9 on chip; Mosaic GPU's stores every row's score, [B, T, H, NC] float32,
    and sums them in XLA. At (32, 16) on the H200 (benchmarks/results/gpu-paper.md) Triton's select alone took 24.7
    ms against 28.7 at 64k, and the Mosaic GPU one's scores grow the peak memory by 12 GiB at 128k. Its claim on
    implementation=None's choice (nsa.triton.CLAIMS)."""
    del static
    return not one_row_per_block(*blocks_of(block_size, compress_block_size, compress_stride))


def forward(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_counts, block_size, scale, compress_block_size=None,
            compress_stride=None, config=None, decode=None):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids), as the reference.

    lse [B, T, HQ] (compressed attention's of the same q and k_cmp) saves the kernel its first pass;
    None computes it. kv_lens int [B] or None places the queries at the end of longer sequences
    (`nsa._varlen.tokens`), which k_cmp covers. decode: whether the decode select (nsa/triton/decode_select.py)
    runs, None where it applies (`nsa.triton._splits.decoding`: a few queries at the end of a cache; without lse,
    compressed attention's decode kernel computes it first). config: the Config of the kernel that runs (a
    decode_select.Config for the decode select; None: its `default_config`). The blocks must be
    `one_row_per_block` (nsa.reference.select) for the decode select (decode=None then runs the training kernel,
    which takes any: Eq. 9's sum, `_topk.eq9_keys`)."""
    block_size, compress_block_size, compress_stride = blocks_of(block_size, compress_block_size, compress_stride)
    blocks = dict(block_size=block_size, compress_block_size=compress_block_size, compress_stride=compress_stride)
    if _splits.decoding(decode if decode or one_row_per_block(**blocks) else False, q, k_cmp, kv_lens, config,
                        (Config, decode_select.Config)):
        unless_one_row_per_block("Triton decode", **blocks)
        if lse is None:
            _, lse = flash_decoding.compressed(q, k_cmp, k_cmp, kv_lens, block_size=block_size, stride=block_size,
                                               scale=scale)
        return decode_select.forward(q, k_cmp, lse, kv_lens, block_counts=block_counts, block_size=block_size,
                                     scale=scale, config=config)
    B, T, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    shapes = Shapes.of(q, k_cmp, block_counts=block_counts, packed=cu_seqlens is not None, **blocks)
    cfg = default_config(shapes, q.dtype, device()) if config is None else config
    _, sized = _sizes(shapes, cached=kv_lens is not None)
    tok = tokens(T, compress_stride, cu_seqlens, kv_lens)
    step = cfg.chunk if shapes.one_row_per_block else eq9_step(cfg.chunk, **blocks)
    check(step > 0, "config", f"chunk > l / d + l' / d - 2 = {cfg.chunk - step}", cfg.chunk)
    per_batch = lambda x: jnp.broadcast_to(x, (B, T))
    lse_arg = jnp.zeros((1,), jnp.float32) if lse is None else lse.astype(jnp.float32)  # unread when None
    [idx] = _launch.launch(
        _select_kernel, grid=(cdiv(T, cfg.tokens), B * H),
        inputs=dict(q=q, k_cmp=k_cmp, lse=lse_arg, pos=per_batch(tok.pos), cmp_start=per_batch(tok.cmp_start)),
        outputs=dict(out=_launch.shape_dtype((B, T, H, sized["S"]), jnp.int32)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, T=T, NC=NC, H=H, G=HQ // H, DK=Dk, BS=block_size,
        SCALE=float(scale), IEEE=bool(q.dtype == jnp.float32), HAS_LSE=lse is not None, TB=cfg.tokens,
        BC=cfg.chunk, CL=compress_block_size, CD=compress_stride, STEP=step, **sized)
    # the slots past S are always unused
    return jnp.pad(idx, [(0, 0)] * 3 + [(0, block_counts - sized["S"])], constant_values=-1)
