"""Block selection for a few queries at the end of a KV cache (`select_blocks` with kv_lens, TQ small), split
over the candidate blocks as flash-decoding splits the keys: the decode side of nsa/triton/select.py.

The TQ queries are the last tokens of each batch row's sequence (query t at position kv_lens[b] - TQ + t); the
contract is nsa.reference.select's with `kv_lens`. At decode, select's training kernel runs one program per
(tokens, b * H + h): at B = 1, H = 4, four programs walk every compressed row of the cache. Here each (b, h)
cuts its candidate blocks into NSPLIT shares (`_decode_split_kernel`, one program each, the TQ queries' G heads
stacked into one tile), each keeping the running top of its share (nsa/triton/_topk.py); the last share of a
(b, h) to finish merges the shares' tops in a fixed order (`_merge_tops`), so the selection is one launch. Compressed attention's lse is given, as lse [B, TQ, HQ] or as the
partial statistics of the decode kernels' compressed splits (the fused step, nsa/triton/decode.py, saves its
combine). Forward only; every array is row-major, token offsets in int64.
"""

from typing import NamedTuple

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa._config import Shapes, as_sequences, positive, power_of_two, validated
from nsa._varlen import cdiv
from nsa.triton import _launch, _splits, _topk
from nsa.triton._common import LOG2E, all_queries, cache_rows, check, device, paging
from nsa.triton._splits import split_stats
from nsa.triton._topk import ids, keys, logits, merge_top, store_top

# `default_config`'s splits aim at PROGRAMS_PER_SM programs on each SM, never more than MAX_SPLITS (the merge
# sorts MAX_SPLITS * SP keys per query). Four programs per SM measured faster than one at every shape of
# benchmarks/decode_tuning.py (the fused decode step: benchmarks/results/decode-tuning.json): a split walks a few
# chunks of compressed rows, each a load, a dot, a top-k merge: latency, which more programs hide.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 64

# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _decode_split_kernel(q, k_cmp, s_cmp, lse, m_cmp, l_cmp, kv_lens, q_lens, pages, top, count, out,
                         TQ: tl.constexpr, NC: tl.constexpr, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                         BS: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr,
                         TQP: tl.constexpr, DKP: tl.constexpr, BC: tl.constexpr, SP: tl.constexpr,
                         IEEE: tl.constexpr, NSPLIT: tl.constexpr, LSE_SPLITS: tl.constexpr,
                         LSE_NSP: tl.constexpr, PAGE: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr,
                         NSP: tl.constexpr, LOGITS: tl.constexpr):
    """Decode: the running top of the TQ queries of one KV head over one share of the candidate blocks.

    The queries are the last tokens of batch row b: its first q_lens[b] rows (all TQ unless a ragged step; the
    others get no block), query t at position p_t = kv_lens[b] - q_lens[b] + t, its
    candidates the blocks 0 .. p_t // BS, block c scored from row c of k_cmp). Grid (B * H, NSPLIT): program
    (b * H + h, split) takes share `split` of the chunks of BC blocks up to the tile's last candidate (cut
    into NSPLIT even shares at run time, so a ragged batch splits each row's own range). Tile: M = TQP * GR
    query rows, row i = token i // GR, head h * G + i % GR (heads >= G and tokens >= TQ masked; TQP * GR >=
    16 for tl.dot). Loads q [B, TQ, HQ, DK] (M x DKP) and lse [B, TQ, HQ] (compressed attention's) once,
    kv_lens [B], then each chunk of k_cmp [B, NC, H, DK] transposed (DKP x BC), only the rows some query
    sees (below min(NC, (p_last + 1) // BS)); with PAGE > 0, k_cmp is a pool of pages of PAGE compressed rows
    read through the page table pages [B, MP] (`cache_rows`). With LOGITS, the chunk's base-2 logits are loaded
    instead from s_cmp [B * H, TQ * G, NC] float32 (the fused step's compressed splits stored them: row
    t * G + g of KV head bh, its columns the rows of the sequence) and neither q nor k_cmp is read. The lse of each row is compressed attention's: lse [B, TQ, HQ]
    (natural log), or with LSE_SPLITS > 0 merged here from the decode kernel's partial statistics m_cmp and
    l_cmp [B * H, LSE_SPLITS, TQ * G] (base 2; `split_stats`, LSE_NSP = LSE_SPLITS padded to a power of two),
    which saves the fused decode step (nsa/triton/decode.py's `attention`) a combine before the selection. Each
    chunk's scores are merged into each token's running top (`merge_top`). With NSPLIT = 1 stores the ids
    into out [B, TQ, H, S] int32 (rank order, -1 unused, `store_top`), else the keys of its top
    (ascending) into top [B * H, NSPLIT, TQP, SP, 2] int32 (each int64 key's high and low halves), then counts
    itself done in count [B * H] (int32, zero at launch; an atomic add, acquire-release at GPU scope, after a
    barrier of its threads): the last split of (b, h) to finish merges the NSPLIT tops (`_merge_tops`). Which
    split is last varies from run to run; what it computes does not.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    M: tl.constexpr = TQP * GR
    kv_len = tl.load(kv_lens + b)
    q_len = tl.load(q_lens + b)  # the row's queries: its first q_len tokens

    tok = tl.arange(0, TQP)
    p_tok = kv_len - q_len + tok
    tok_ok = (tok < q_len) & (p_tok >= 0)
    cur = tl.where(tok_ok, p_tok // BS, -1)  # each token's current block (-1: no candidates)

    i = tl.arange(0, M)
    t_row = i // GR
    p_row = kv_len - q_len + t_row
    row_ok = (i % GR < G) & (t_row < q_len) & (p_row >= 0)
    end_row = tl.where(row_ok, tl.minimum((p_row + 1) // BS, NC), 0)  # the row's visible rows [0, end_row)
    q_row = (b * TQ + t_row) * (H * G) + h * G + i % GR  # int64 row of q and lse
    if LOGITS:
        s_row = (bh.to(tl.int64) * TQ + t_row) * G + i % GR  # int64 row of s_cmp
    else:
        dk = tl.arange(0, DKP)
        q_tile = tl.load(q + q_row[:, None] * DK + dk[None, :], mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)
    if LSE_SPLITS == 0:
        lse2 = tl.load(lse + q_row, mask=row_ok, other=float("-inf")) * LOG2E
    else:
        part_row = bh.to(tl.int64) * LSE_SPLITS * (TQ * G) + t_row * G + i % GR  # split 0's row of m_cmp, l_cmp
        _, _, lse2 = split_stats(m_cmp, l_cmp, part_row, row_ok, R=TQ * G, NSPLIT=LSE_SPLITS, NSP=LSE_NSP,
                                  CACHE="")
    seen = lse2 > float("-inf")  # rows that see no compressed row get p = 0, never NaN
    lse2 = tl.where(seen, lse2, 0.0)

    vis_end = tl.max(end_row, 0)  # no query sees a row >= vis_end
    chunks = (tl.max(cur, 0) + BC) // BC  # the chunks up to the last candidate block
    per = (chunks + NSPLIT - 1) // NSPLIT
    best = tl.full([TQP, SP], -1, tl.int64)  # ascending keys: slot SP - 1 ranks first
    for chunk in range(split * per, tl.minimum(chunks, split * per + per)):
        rows = chunk * BC + tl.arange(0, BC)
        load = rows < vis_end
        if LOGITS:
            s = tl.load(s_cmp + s_row[:, None] * NC + rows[None, :], mask=row_ok[:, None] & load[None, :], other=0.0)
        else:
            k_rows = cache_rows(pages, b, rows, load, h, NK=NC, H=H, PAGE=PAGE, MP=MP, NP=NP)
            s = logits(q_tile, k_cmp, k_rows, load, DK=DK, DKP=DKP, SCALE=SCALE, IEEE=IEEE)
        p = tl.where((rows[None, :] < end_row[:, None]) & seen[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        score = tl.sum(tl.reshape(p, [TQP, GR, BC]), 1) / G
        best = merge_top(best, keys(score, rows[None, :], cur), S=S, SP=SP)

    if NSPLIT == 1:
        store_top(out, (b * TQ + tok) * H + h, best, tok < TQ, S=S, SP=SP)
    else:
        at = ((bh.to(tl.int64) * NSPLIT + split) * TQP + tok)[:, None] * SP + tl.arange(0, SP)[None, :]
        tl.store(top + 2 * at, (best >> 32).to(tl.int32))  # int32 halves: jax has no int64 without x64
        tl.store(top + 2 * at + 1, best.to(tl.int32))
        tl.debug_barrier()  # every thread's stores before the release
        if tl.atomic_add(count + bh, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:
            _merge_tops(top, out, bh, b, h, TQ=TQ, H=H, S=S, TQP=TQP, SP=SP, NSPLIT=NSPLIT, NSP=NSP)


@triton.jit
def _merge_tops(top, out, bh, b, h, TQ: tl.constexpr, H: tl.constexpr, S: tl.constexpr, TQP: tl.constexpr,
                SP: tl.constexpr, NSPLIT: tl.constexpr, NSP: tl.constexpr):
    """The NSPLIT splits' tops of KV head h of batch row b (bh = b * H + h) merged, token after token, in a fixed
    order (deterministic): loads token t's tops from top [B * H, NSPLIT, TQP, SP, 2] int32 (NSP * SP int64 keys
    in halves, NSP = NSPLIT padded to a power of two, -1 past NSPLIT; through L2, `.cg`: other SMs wrote them)
    and stores its S best as block ids into out [B, TQ, H, S] int32 (rank order, -1 unused)."""
    j = tl.arange(0, NSP * SP)
    split = j // SP
    slot = tl.arange(0, SP)
    for t in range(TQ):
        at = ((bh.to(tl.int64) * NSPLIT + split) * TQP + t) * SP + j % SP
        high = tl.load(top + 2 * at, mask=split < NSPLIT, other=-1, cache_modifier=".cg")
        low = tl.load(top + 2 * at + 1, mask=split < NSPLIT, other=-1, cache_modifier=".cg")
        keys = (high.to(tl.int64) << 32) | (low.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + ((b * TQ + t) * H + h) * S + slot, ids(tl.topk(keys, SP)), mask=slot < S)


# ------------------------------------------------------------------------------------ wrappers


@validated
class Config(NamedTuple):
    """The launch of the decode select: BC compressed rows per step, NSPLIT splits of each (b, h)'s chunks (1: no
    merge of their tops), the split kernel's warps and pipeline stages."""

    chunk: int
    splits: int
    num_warps: int
    num_stages: int

    def check(self):
        power_of_two(self, "chunk", "num_warps")
        positive(self, "splits", "num_stages")


def _tokens(TQ, GR):
    """TQP, the decode tile's tokens: TQ padded to a power of two, with at least 16 rows (TQP * GR)."""
    return max(triton.next_power_of_2(TQ), 16 // GR)


def _sizes(shapes):
    """(NB, the candidate blocks of the longest sequence; nsa.triton._topk.sizes) of a cache's queries."""
    blocks = _topk.num_blocks(shapes.T, shapes.TK, shapes.block_size, cached=True)
    return blocks, _topk.sizes(shapes.G, shapes.Dk, shapes.block_counts, blocks)


def default_config(shapes, dtype, device):
    """The Config of the queries q [B, TQ, HQ, Dk] at the end of a cache against k_cmp [B, NC, H, Dk]:
    `nsa._config.Shapes.of(q, k_cmp, block_size=..., block_counts=S)` (TK = NC).

    BC: 64 compressed rows per step, fewer (>= 16) when there are fewer blocks, at least SP (select's
    `default_config`). NSPLIT: cdiv(device.cores * PROGRAMS_PER_SM, B * H) splits, never more than the chunks of
    the longest sequence (its NC + 1 candidate blocks) nor MAX_SPLITS; 1 (no merge) from B * H >= cores *
    PROGRAMS_PER_SM. Eight warps when a tile passes 16 KiB (q [M, DKP], the key chunk [DKP, BC], the float32
    logits [M, BC]); two stages once a split walks four chunks or more.
    """
    blocks, sized = _sizes(shapes)
    itemsize = jnp.dtype(dtype).itemsize
    bc = _topk.chunk(sized["SP"], blocks)
    chunks = cdiv(blocks + 1, bc)
    splits = _splits.splits(chunks, shapes.B * shapes.H, PROGRAMS_PER_SM, device, most=MAX_SPLITS)
    m = _tokens(shapes.T, sized["GR"]) * sized["GR"]
    largest = max(m * sized["DKP"] * itemsize, sized["DKP"] * bc * itemsize, m * bc * 4)
    return Config(bc, splits, 8 if largest > 16384 else 4, 2 if cdiv(chunks, splits) >= 4 else 1)


def forward(q, k_cmp, lse, kv_lens, *, block_counts, block_size, scale, config=None, lse_parts=None,
            page_table=None, q_lens=None, logits=None):
    """block_indices int32 [B, TQ, H, block_counts] for a few queries q [B, TQ, HQ, Dk] at the end of a cache
    (kv_lens int [B]) against its compressed keys k_cmp [B, NC, H, Dk], as nsa.reference.select with kv_lens:
    one launch of `_decode_split_kernel` (its last split of each (b, h) merges the splits' tops). Compressed attention's lse is given as
    lse [B, TQ, HQ] float32, or as lse_parts (then lse is None): the (m, l) partial statistics [B * H, NSPLIT,
    TQ * G] of the decode kernels' compressed splits. config: a Config (None: `default_config`). With page_table
    int [B, MP] (a paged cache), k_cmp is its pool of pages [P, S / d, H, Dk], read through the table. With q_lens
    int32 [B], sequence b's queries are the first q_lens[b] rows of q (its last q_lens[b] tokens), the others get
    no block (-1). With logits [B * H, TQ * G, NC] float32, the base-2 scaled logits of q against k_cmp (the fused
    step's compressed splits store them), the kernel reads them instead of q and k_cmp."""
    pages, pages_meta = paging(page_table, k_cmp)
    k_pool, k_cmp = k_cmp, as_sequences(k_cmp, page_table)
    B, TQ, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    check((lse is None) != (lse_parts is None), "lse, lse_parts", "exactly one of them",
          f"lse {'None' if lse is None else 'given'} and lse_parts {'None' if lse_parts is None else 'given'}")
    check(kv_lens.shape == (B,), "kv_lens", f"shape [B] = ({B},)", tuple(kv_lens.shape))
    kv_lens = kv_lens.astype(jnp.int32)
    if logits is not None:
        want = (B * H, TQ * (HQ // H), NC)
        check(logits.shape == want and logits.dtype == jnp.float32, "logits", f"float32 [B * H, TQ * G, NC] = {want}",
              f"{logits.dtype} {tuple(logits.shape)}")
    unused = jnp.zeros((1,), jnp.float32)
    m_cmp, l_cmp = (unused, unused) if lse_parts is None else lse_parts
    lse_splits = 0 if lse_parts is None else m_cmp.shape[1]
    shapes = Shapes.of(q, k_cmp, block_size=block_size, block_counts=block_counts)
    cfg = default_config(shapes, q.dtype, device()) if config is None else config
    _, sized = _sizes(shapes)
    tqp, S, SP = _tokens(TQ, sized["GR"]), sized["S"], sized["SP"]
    check(cfg.chunk >= SP, "config.chunk", f"at least SP = {SP} (the slots padded: tl.topk takes SP rows)", cfg.chunk)
    out = _launch.shape_dtype((B, TQ, H, S), jnp.int32)
    top = _launch.shape_dtype((B * H, cfg.splits, tqp, SP, 2) if cfg.splits > 1 else (1,), jnp.int32)
    count = _launch.shape_dtype((B * H,) if cfg.splits > 1 else (1,), jnp.int32)
    _, _, idx = _launch.launch(
        _decode_split_kernel, grid=(B * H, cfg.splits),
        inputs=dict(q=q, k_cmp=k_pool, s_cmp=unused if logits is None else logits,
                    lse=unused if lse is None else lse.astype(jnp.float32), m_cmp=m_cmp,
                    l_cmp=l_cmp, kv_lens=kv_lens, q_lens=all_queries(q) if q_lens is None else q_lens,
                    pages=pages),
        outputs=dict(top=top, count=count, out=out), zeroed=("count",), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, TQ=TQ, NC=NC, H=H,
        G=HQ // H, DK=Dk, BS=block_size, SCALE=float(scale), IEEE=bool(q.dtype == jnp.float32), TQP=tqp,
        BC=cfg.chunk, NSPLIT=cfg.splits, LSE_SPLITS=lse_splits, LSE_NSP=triton.next_power_of_2(max(1, lse_splits)),
        NSP=triton.next_power_of_2(cfg.splits), LOGITS=logits is not None, **sized, **pages_meta)
    return jnp.pad(idx, [(0, 0)] * 3 + [(0, block_counts - S)], constant_values=-1)
