"""What the two block-selection kernels share (nsa/triton/select.py for training and prefill, nsa/triton/
decode_select.py for a few queries at the end of a KV cache): the compressed logits of a key chunk, the running
top of each token as sortable keys, its merge with a chunk and its store as block ids; and the sizes that the
shapes fix.

The top is kept as sortable int64 keys (score bits << 32 | (2^31 - 1 - block id)): scores are >= 0, so the
key order is the rank order, ties going to the lower id. A chunk's best SP keys (tl.topk, descending) against
the running top (ascending) take their elementwise maximum, the SP best of both as a bitonic sequence, which
tl.bitonic_merge sorts again; chunks that cannot enter any token's top are skipped. Blocks 0, p // bs - 1 and
p // bs are forced (nsa.reference.select's ranks, above any score).
"""

import triton
import triton.language as tl

from nsa._plan import num_candidates
from nsa.reference import select as reference
from nsa.triton._common import LOG2E, pow2

# the forced blocks' ranks, nsa.reference.select's
CURRENT, PREVIOUS, FIRST = (tl.constexpr(r) for r in (reference.CURRENT, reference.PREVIOUS, reference.FIRST))


@triton.jit
def logits(q_tile, k_cmp, k_rows, load, DK: tl.constexpr, DKP: tl.constexpr, SCALE: tl.constexpr,
           IEEE: tl.constexpr):
    """Base-2 logits [M, BC] of the tile's query rows q_tile [M, DKP] against a chunk of compressed rows: k_rows
    [BC], their int64 rows of k_cmp seen as rows of DK (`nsa.triton._common.sequence_rows`, `cache_rows`); loads
    the chunk transposed, [DKP, BC], only where `load` (the others read as 0). The caller masks the logits of rows
    a query does not see: a row loaded for another token of the tile may hold anything (NaN too), and it only
    spoils its own column."""
    dk = tl.arange(0, DKP)
    k_t = tl.load(k_cmp + k_rows[None, :] * DK + dk[:, None], mask=load[None, :] & (dk < DK)[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q_tile, k_t, input_precision="ieee")
    else:
        s = tl.dot(q_tile, k_t)
    return s * (SCALE * LOG2E)


@triton.jit
def keys(score, blk, cur):
    """Sortable int64 keys [TB, BC] of the chunk's blocks from their scores [TB, BC].

    blk [TB, BC] are the in-sequence block ids of each token, cur [TB] its current block. The forced
    ranks of nsa.reference.select (FIRST, PREVIOUS, CURRENT) replace the scores, in its order;
    candidates (0 <= blk <= cur) get (float bits of the rank) << 32 | (2^31 - 1 - blk), which orders
    as (rank, -blk) since ranks are >= 0; every other block gets -1, below any candidate.
    """
    rank = tl.where(blk == 0, FIRST, score)
    rank = tl.where(blk == cur[:, None] - 1, PREVIOUS, rank)
    rank = tl.where(blk == cur[:, None], CURRENT, rank)
    key = (rank.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - blk).to(tl.int64)
    return tl.where((blk >= 0) & (blk <= cur[:, None]), key, -1)


@triton.jit
def complete_rows(p, BS: tl.constexpr, CL: tl.constexpr, CD: tl.constexpr):
    """How many compressed rows the query at position p sees (nsa._varlen.complete_rows): windows of CL tokens
    every CD wholly in its past; (p + 1) // BS when they are the selection blocks of BS tokens."""
    if CL == BS and CD == BS:
        n = (p + 1) // BS
    else:
        n = tl.maximum(p + 1 - CL + CD, 0) // CD
    return n


@triton.jit
def eq9_keys(score, rows, first, cur, BC: tl.constexpr, BS: tl.constexpr, CL: tl.constexpr, CD: tl.constexpr):
    """Sortable keys [TB, BC] (`keys`) of the selection blocks named by a chunk of compressed rows, from the rows'
    scores score [TB, BC] (mean_g p_g(r) of the global rows `rows` [BC]; first [TB]: each token's sequence's
    first row, cur [TB]: its current block), for windows of CL tokens every CD under blocks of BS (Eq. 9 as
    nsa.reference.select's `block_scores`): block j of a token scores sum_o count(o) * score[first + UB * j + o],
    o from -(UR - 1) to UB - 1 (UB = BS / CD, UR = CL / CD), summed in that order. The chunk holds the rows of
    the blocks whose row first + UB * j lies in [rows[UR - 1], rows[BC - UB]] (`eq9_step` rows apart, chunks
    overlap by UR + UB - 2 rows): every other column's key is -1 (no candidate)."""
    UB: tl.constexpr = BS // CD
    UR: tl.constexpr = CL // CD
    c = tl.arange(0, BC)
    total = tl.zeros_like(score)
    for i in tl.static_range(UR + UB - 1):
        o = i - (UR - 1)  # a constexpr: i is
        at = tl.broadcast_to(tl.minimum(tl.maximum(c + o, 0), BC - 1)[None, :], score.shape)
        count = tl.minimum(UB, UR + o) - tl.maximum(0, o)
        total += count * tl.gather(score, at, 1)
    rel = rows[None, :] - first[:, None]  # in-sequence row
    owned = (c >= UR - 1) & (c <= BC - UB)
    named = owned[None, :] & (rel >= 0) & (rel % UB == 0)
    return keys(total, tl.where(named, rel // UB, -1), cur)


def eq9_step(chunk, block_size, compress_block_size, compress_stride):
    """How far apart the chunks of `eq9_keys` start: chunk rows less the UR + UB - 2 that two chunks share."""
    return chunk - (compress_block_size + block_size) // compress_stride + 2


@triton.jit
def merge_top(top, key, S: tl.constexpr, SP: tl.constexpr):
    """Each token's running top [TB, SP] (ascending keys, slot SP - 1 ranks first) merged with the keys
    [TB, BC] of a chunk: the SP best of both, unless no key can enter any token's top-S (skipped)."""
    kth = tl.max(tl.where(tl.arange(0, SP)[None, :] == SP - S, top, -1), 1)  # [TB]: each token's S-th best
    if tl.max((tl.max(key, 1) > kth).to(tl.int32), 0) > 0:  # some token's top-S changes
        # max of ascending and descending: the SP best of both, bitonic
        top = tl.bitonic_merge(tl.maximum(top, tl.topk(key, SP, dim=1)), dim=1)
    return top


@triton.jit
def ids(key):
    """The block ids (int32) of sortable keys, -1 for the keys of no candidate (-1)."""
    return tl.where(key >= 0, 0x7FFFFFFF - (key & 0x7FFFFFFF), -1).to(tl.int32)


@triton.jit
def store_top(out, out_rows, top, ok, S: tl.constexpr, SP: tl.constexpr):
    """The block ids of each token's running top [TB, SP] (ascending keys) into its row out_rows [TB] of out
    [.., S] int32 in rank order (-1 in unused slots), for the tokens that are ok."""
    out_slot = SP - 1 - tl.arange(0, SP)  # top is ascending
    tl.store(out + out_rows[:, None] * S + out_slot[None, :], ids(top), mask=ok[:, None] & (out_slot < S)[None, :])


def num_blocks(T, NC, block_size, cached, compress_stride=None):
    """NB, the most in-sequence blocks a query can have: those of the T queries, or with a KV cache (cached)
    those of the longest sequence that the NC compressed rows (one every compress_stride tokens, None:
    block_size) cover (nsa._plan.num_candidates, as nsa.reference.select)."""
    return num_candidates(T, NC, block_size, True if cached else None, compress_stride)


def chunk(sp, blocks):
    """BC: 64 compressed rows per step, fewer (>= 16) when there are fewer blocks, at least SP (tl.topk takes SP
    of them)."""
    return max(sp, min(64, max(16, triton.next_power_of_2(blocks))))


def sizes(G, Dk, block_counts, blocks):
    """What the shapes fix: GR (the group G padded to a power of two), DKP (Dk padded, >= 16), S (the slots the
    kernel fills: at most the `blocks` of the longest sequence) and SP (S padded, >= 2)."""
    slots = min(block_counts, blocks)
    return dict(GR=triton.next_power_of_2(G), DKP=pow2(Dk), S=slots, SP=max(2, triton.next_power_of_2(slots)))
