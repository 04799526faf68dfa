"""One masked flash-attention kernel family, shared by the sliding-window and compressed branches.

The two branches differ only in which keys a query sees, and in both the visible keys of query t
form one interval [lo[t], hi[t]] of key rows (empty when lo > hi):

- sliding window: lo = max(sequence start, r - window_size + 1), hi = r, keys = k [B, TK, H, Dk], with
  r = start + pos(t) the query's own key row;
- compressed: lo = cmp_start(t), hi = cmp_start(t) + (pos(t) + 1) // block_size - 1, keys = k_cmp.

The op modules (window.py, compressed.py) compute lo and hi from `nsa._varlen.tokens`, so batched,
packed and cached sequences take one code path: int32 [T] shared by the batch, or [B, T] per batch row
with kv_lens (a KV cache: query t of batch row b at position kv_lens[b] - T + t, the NK key rows possibly
more than the T queries); the kernels take them as [B, T]. Both ends are non-decreasing in t, hence the
queries that see key row r also form an interval [first[r], last[r]] (two searchsorted, in XLA), which
bounds the loop of the dk/dv kernel. With kv_lens (CACHE) the forward and dq kernels load no key row past
the last one their query tile sees, the dk/dv kernel no row that no query sees: a cache's rows past a
sequence's length may hold anything, NaN too, and a loaded NaN times p = 0 would still be NaN. Without it
every row of k is a real key, and the loads are bounded by NK alone, uniformly over a tile when BLOCK_N
divides NK (the compiler then keeps one predicate per tile, not one per row).

Layouts (contiguous): q [B, T, HQ, Dk], k [B, NK, H, Dk], v [B, NK, H, Dv], o / do [B, T, HQ, Dv],
lse / delta [B, T, HQ] float32, lo / hi [B, T] and first / last [B, NK] int32. Query head hq uses KV head
hq // G, G = HQ // H. Head dims are padded to powers of two (>= 16) with masked loads; the logits are kept
in base 2 (exp2) inside the kernels, lse is stored in natural log. All accumulation is float32; no
atomics, so results are deterministic.
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa import _device, _varlen
from nsa._config import expect, positive, power_of_two, validated
from nsa._plan import kernel_delta
from nsa._varlen import cdiv
from nsa.triton import _launch
from nsa.triton._common import LN2, LOG2E, check, check_keys, mm, online_step, pow2


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _tile(X, rows, valid, offs, D: tl.constexpr):
    """The tile [len(rows), len(offs)] of the rows `rows` (int64) of X [..., D] (row-major), columns offs
    (a power-of-two padding of D); rows that are not valid and columns >= D read as 0."""
    return tl.load(X + rows[:, None] * D + offs[None, :], mask=valid[:, None] & (offs[None, :] < D), other=0.0)


@triton.jit
def _query_tile(LO, HI, T: tl.constexpr, NK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The queries of a (query tile program_id(0), b * HQ + hq = program_id(1)) program: (b as int64, the
    KV head h, the int64 rows (b * T + t) * HQ + hq of its BLOCK_M queries, which of them exist, their
    lo / hi from LO / HI [B, T] (padded queries see nothing), and the key rows [k_begin, k_end) any of them
    sees, k_begin aligned to BLOCK_N, k_end <= NK)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    hq = bh % HQ
    h = hq // (HQ // H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < T
    lo = tl.load(LO + b * T + offs_m, mask=m_valid, other=1)
    hi = tl.load(HI + b * T + offs_m, mask=m_valid, other=0)
    seen = lo <= hi
    k_begin = tl.min(tl.where(seen, lo, NK), 0)
    k_end = tl.max(tl.where(seen, hi, -1), 0) + 1
    k_begin = (k_begin // BLOCK_N) * BLOCK_N
    q_rows = (b * T + offs_m) * HQ + hq
    return b, h, q_rows, m_valid, lo, hi, k_begin, k_end


@triton.jit
def _key_tile(K, V, q, lo, hi, n0, k_end, b, h, offs_dk, offs_dv, qk_scale, NK: tl.constexpr, H: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, CACHE: tl.constexpr):
    """The key rows [n0, n0 + BLOCK_N) of KV head h against the query tile q (forward and dq): k
    [BLOCK_N, BLOCK_DK] and v [BLOCK_N, BLOCK_DV] of K [B, NK, H, DK] / V [B, NK, H, DV] (rows past NK, and
    with CACHE those from k_end on, past the tile's last visible one, read as 0), the base-2 logits
    [BLOCK_M, BLOCK_N], and which of them each query sees (key row in [lo, hi])."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < (k_end if CACHE else NK)
    kv_rows = (b * NK + offs_n) * H + h
    k = _tile(K, kv_rows, n_valid, offs_dk, DK)
    v = _tile(V, kv_rows, n_valid, offs_dv, DV)
    s = mm(q, tl.trans(k), IEEE) * qk_scale
    return k, v, s, (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= hi[:, None])


@triton.jit
def _softmax_stats(LSE, DELTA, q_rows, m_valid):
    """For the backward: whether each query row saw anything, its lse in base 2 (0 where it saw
    nothing) and its delta, from lse / delta [B, T, HQ]."""
    lse = tl.load(LSE + q_rows, mask=m_valid, other=float("-inf"))
    delta = tl.load(DELTA + q_rows, mask=m_valid, other=0.0)
    row_seen = lse > float("-inf")
    return row_seen, tl.where(row_seen, lse * LOG2E, 0.0), delta


@triton.jit
def _fwd_kernel(Q, K, V, LO, HI, O, LSE,
                T: tl.constexpr, NK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
                CACHE: tl.constexpr):
    """Forward: o [B, T, HQ, Dv] and lse [B, T, HQ] (natural log, -inf where nothing is seen).

    Grid (cdiv(T, BLOCK_M), B * HQ). One program owns the BLOCK_M queries [m0, m0 + BLOCK_M) of one
    query head: it loads their q tile [BLOCK_M, BLOCK_DK] and lo / hi [B, T] once, then walks the key tiles
    of BLOCK_N rows from the tile's smallest lo to its largest hi (only tiles that can be visible),
    loading k [BLOCK_N, BLOCK_DK] and v [BLOCK_N, BLOCK_DV] of KV head hq // G (with CACHE up to that
    largest hi), with an online softmax in float32.
    """
    b, h, q_rows, m_valid, lo, hi, k_begin, k_end = _query_tile(LO, HI, T=T, NK=NK, HQ=HQ, H=H, BLOCK_M=BLOCK_M,
                                                                BLOCK_N=BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _tile(Q, q_rows, m_valid, offs_dk, DK)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = SCALE * LOG2E  # base-2 logits
    for n0 in range(k_begin, k_end, BLOCK_N):
        k, v, s, visible = _key_tile(K, V, q, lo, hi, n0, k_end, b, h, offs_dk, offs_dv, qk_scale, NK=NK, H=H,
                                     DK=DK, DV=DV, BLOCK_N=BLOCK_N, IEEE=IEEE, CACHE=CACHE)
        m_i, l_i, acc = online_step(m_i, l_i, acc, s, v, visible, IEEE)

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(O + q_rows[:, None] * DV + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=m_valid[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + q_rows, lse, mask=m_valid)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, LO, HI, DQ,
                   T: tl.constexpr, NK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
                   CACHE: tl.constexpr):
    """Backward for q: dq [B, T, HQ, Dk] = scale * sum_j p * (dp - delta) k_j.

    Grid (cdiv(T, BLOCK_M), B * HQ), the forward's tiling: one program loads q [BLOCK_M, BLOCK_DK],
    do [BLOCK_M, BLOCK_DV], lse, delta (= sum(o * do) - dlse, from XLA) and lo / hi [B, T] of its queries,
    walks the same key tiles as the forward (k [BLOCK_N, BLOCK_DK], v [BLOCK_N, BLOCK_DV]),
    recomputes p from lse, and stores dq once.
    """
    b, h, q_rows, m_valid, lo, hi, k_begin, k_end = _query_tile(LO, HI, T=T, NK=NK, HQ=HQ, H=H, BLOCK_M=BLOCK_M,
                                                                BLOCK_N=BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _tile(Q, q_rows, m_valid, offs_dk, DK)
    do = _tile(DO, q_rows, m_valid, offs_dv, DV)
    row_seen, lse2, delta = _softmax_stats(LSE, DELTA, q_rows, m_valid)

    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    qk_scale = SCALE * LOG2E
    for n0 in range(k_begin, k_end, BLOCK_N):
        k, v, s, visible = _key_tile(K, V, q, lo, hi, n0, k_end, b, h, offs_dk, offs_dv, qk_scale, NK=NK, H=H,
                                     DK=DK, DV=DV, BLOCK_N=BLOCK_N, IEEE=IEEE, CACHE=CACHE)
        visible = visible & row_seen[:, None]
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = mm(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += mm(ds.to(k.dtype), k, IEEE)

    tl.store(DQ + q_rows[:, None] * DK + offs_dk[None, :], (dq * SCALE).to(DQ.dtype.element_ty),
             mask=m_valid[:, None] & (offs_dk[None, :] < DK))


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, LO, HI, FIRST, LAST, DK_OUT, DV_OUT,
                     T: tl.constexpr, NK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
                     CACHE: tl.constexpr, SPLIT_M: tl.constexpr, HEAD_SPLITS: tl.constexpr):
    """Backward for k and v: dk [NSPLIT, B, NK, H, Dk], dv [NSPLIT, B, NK, H, Dv], summed over the queries of
    one split of SPLIT_M queries and over the query heads of one split of G / HEAD_SPLITS heads (the caller
    sums the NSPLIT = query splits * HEAD_SPLITS partials).

    Grid (cdiv(NK, BLOCK_N), NSPLIT, B * H). One program owns the key rows [n0, n0 + BLOCK_N) of one
    KV head h, the queries [s * SPLIT_M, (s + 1) * SPLIT_M) and the query heads h * G + g, g in
    [r * G / HEAD_SPLITS, (r + 1) * G / HEAD_SPLITS), for split index program_id(1) = s * HEAD_SPLITS + r: it
    loads the query range [first, last] of each row (FIRST / LAST [B, NK]), and k [BLOCK_N, BLOCK_DK] and v
    [BLOCK_N, BLOCK_DV] (with CACHE only the rows some query sees, the others read as 0) once, then for each of
    its query heads walks only the query tiles of BLOCK_M queries of its split between the smallest first and
    the largest last (the queries that can see the tile; rows of several packed sequences may share a tile),
    loading q, do, lse, delta and lo / hi of each. dk and dv accumulate in float32 in registers and are
    stored once (every row, zero for rows nobody sees). Splitting keeps the GPU busy where there are few key
    tiles: the queries when each key tile sees many of them (compressed attention: NK = T / block_size), the
    heads when each sees few (a short sliding window).
    """
    pid_n = tl.program_id(0)
    split = tl.program_id(1) // HEAD_SPLITS
    heads = tl.program_id(1) % HEAD_SPLITS
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    G: tl.constexpr = HQ // H
    GS: tl.constexpr = G // HEAD_SPLITS  # HEAD_SPLITS divides G

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < NK
    first = tl.load(FIRST + b * NK + offs_n, mask=n_valid, other=T)
    last = tl.load(LAST + b * NK + offs_n, mask=n_valid, other=-1)
    used = first <= last
    q_begin = tl.min(tl.where(used, first, T), 0)
    q_end = tl.max(tl.where(used, last, -1), 0) + 1
    q_begin = tl.maximum((q_begin // BLOCK_M) * BLOCK_M, split * SPLIT_M)  # SPLIT_M: a multiple of BLOCK_M
    q_end = tl.minimum(q_end, (split + 1) * SPLIT_M)

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_rows = (b * NK + offs_n) * H + h
    loaded = used if CACHE else n_valid
    k = _tile(K, kv_rows, loaded, offs_dk, DK)
    v = _tile(V, kv_rows, loaded, offs_dv, DV)

    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    qk_scale = SCALE * LOG2E
    for g in range(heads * GS, (heads + 1) * GS):
        hq = h * G + g
        for m0 in range(q_begin, q_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_valid = offs_m < T
            lo = tl.load(LO + b * T + offs_m, mask=m_valid, other=1)
            hi = tl.load(HI + b * T + offs_m, mask=m_valid, other=0)
            q_rows = (b * T + offs_m) * HQ + hq
            q = _tile(Q, q_rows, m_valid, offs_dk, DK)
            do = _tile(DO, q_rows, m_valid, offs_dv, DV)
            row_seen, lse2, delta = _softmax_stats(LSE, DELTA, q_rows, m_valid)
            # transposed tiles [BLOCK_N, BLOCK_M]: key rows by queries
            s_t = mm(k, tl.trans(q), IEEE) * qk_scale
            visible = (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] <= hi[None, :]) & row_seen[None, :]
            p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv += mm(p_t.to(do.dtype), do, IEEE)
            dp_t = mm(v, tl.trans(do), IEEE)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += mm(ds_t.to(q.dtype), q, IEEE)

    out_rows = tl.program_id(1).to(tl.int64) * tl.num_programs(2) * NK + kv_rows  # [NSPLIT, B, NK, H] rows
    tl.store(DK_OUT + out_rows[:, None] * DK + offs_dk[None, :], (dk * SCALE).to(DK_OUT.dtype.element_ty),
             mask=n_valid[:, None] & (offs_dk[None, :] < DK))
    tl.store(DV_OUT + out_rows[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=n_valid[:, None] & (offs_dv[None, :] < DV))


# ------------------------------------------------------------------------------------ launches


@validated
class Config(NamedTuple):
    """The launches of the flash kernels, forward and backward (one Config type for the three kernels, each
    phase taking its own fields): the forward's tiles of block_m queries by block_n keys and its pipeline
    stages; the backward's tiles (bwd_block_m x bwd_block_n, both the dq and the dk/dv kernel) and stages, and
    how many splits of the queries and of the G query heads of a KV head (head_splits divides G) the dk/dv
    kernel sums (its grid's second axis holds splits * head_splits); the warps of every kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    bwd_block_m: int
    bwd_block_n: int
    bwd_num_stages: int
    splits: int = 1
    head_splits: int = 1

    def check(self):
        power_of_two(self, "block_m", "block_n", "bwd_block_m", "bwd_block_n", "num_warps")
        for field in ("block_m", "block_n", "bwd_block_m", "bwd_block_n"):
            expect(getattr(self, field) >= 16, self, field, "at least 16 (tl.dot's smallest side)")
        positive(self, "num_stages", "bwd_num_stages", "splits", "head_splits")


def default_config(shapes, dtype, device):
    """The Config of q [B, T, HQ, Dk] against k [B, NK, H, Dk] and v [B, NK, H, Dv]: `nsa._config.Shapes.of(q, k,
    v, window_size=...)` for the sliding window, `Shapes.of(q, k_cmp, v_cmp, block_size=...)` for the compressed
    branch (TK = NK). The window's queries that see one key row number at most min(window_size, T), the
    compressed rows' T (the query span `_query_splits` cuts).

    64 x 64 tiles with 4 warps, forward in 3 stages and backward in 2, were the fastest on an H200 (bf16, head
    dim 128: benchmarks/ops.py --sweep, benchmarks/results/ops-65536.json). Wider heads and float32 (twice the
    bytes) get smaller tiles or fewer stages, so that the tiles of all stages fit in shared memory.
    """
    d = max(pow2(shapes.Dk), pow2(shapes.Dv))
    wide, single = d > 128, jnp.dtype(dtype).itemsize > 2
    block_m, block_n = (64, 32) if wide else (64, 64)
    bwd_m, bwd_n = (32, 32) if wide else (32, 64) if single and d > 64 else (64, 64)
    if single and wide:
        block_m, bwd_m = max(16, block_m // 2), max(16, bwd_m // 2)
    block_m, bwd_m = min(block_m, pow2(shapes.T)), min(bwd_m, pow2(shapes.T))
    block_n, bwd_n = min(block_n, pow2(shapes.TK)), min(bwd_n, pow2(shapes.TK))
    key_tiles = cdiv(shapes.TK, bwd_n) * shapes.B * shapes.H
    if shapes.block_size:  # compressed: a key row is seen by every later query
        splits, head_splits = _query_splits(shapes.T, key_tiles, shapes.T, bwd_m, device), 1
    else:  # the window: by at most window_size queries, one split of T / splits already holds them all
        splits, head_splits = 1, _head_splits(shapes.G, key_tiles, device)
    return Config(block_m, block_n, 8 if wide else 4, 2 if wide or single else 3, bwd_m, bwd_n, 2, splits,
                  head_splits)


# the dk/dv grid _query_splits aims at: 2048 programs on the device the measurement ran on (1024, 2048 and 4096
# timed: benchmarks/results/ops-pipelining-ab.json, compressed attention at T = 65536), scaled to a device's SMs
_DKDV_PROGRAMS, _MEASURED_ON = 2048, "NVIDIA H200"


def _wanted_splits(key_tiles, device):
    """How many programs per key tile (of all batch rows and KV heads) fill the GPU and balance it: about
    _DKDV_PROGRAMS on _MEASURED_ON, as many per SM on `device`."""
    programs = _DKDV_PROGRAMS * device.cores // _device.TABLE[_MEASURED_ON].cores
    return cdiv(programs, max(1, key_tiles))  # no key tile: k_cmp of 0 rows


def _query_splits(T, key_tiles, query_span, block_m, device):
    """How many splits of the queries the dk/dv kernel takes where a key row is seen by up to query_span queries
    (all later ones: compressed attention).

    Enough programs to fill the GPU (`_wanted_splits`; half of them idle where the attention is causal) when few
    key tiles each see many queries; never splits of fewer than 256 queries, nor more splits than the
    query_span needs. The partial sums then take NSPLIT * B * NK * H * (Dk + Dv) * 4 bytes, bounded by about
    programs * BLOCK_N * (Dk + Dv) * 4 (134 MiB for 2048 programs of 64 x 64 tiles, Dk = Dv = 128).
    """
    return max(1, min(_wanted_splits(key_tiles, device), cdiv(query_span, 256), cdiv(T, block_m)))


def _head_splits(G, key_tiles, device):
    """How many splits of a KV head's G query heads the window's dk/dv kernel takes: the largest divisor of G
    up to `_wanted_splits` (the window at T = 8192 on an H200: 512 key tiles, 4 splits; from 32768 on, 1)."""
    wanted = _wanted_splits(key_tiles, device)
    return max(d for d in range(1, G + 1) if G % d == 0 and d <= wanted)


def _meta(q, k, v, lo, scale, cfg, backward):
    """The constexprs of every flash kernel of one phase (its tiles and stages); CACHE: lo per batch row
    (kv_lens), k and v a KV cache."""
    _, T, HQ, dk = q.shape
    NK, H, dv = k.shape[1], k.shape[2], v.shape[3]
    tile = (cfg.bwd_block_m, cfg.bwd_block_n, cfg.bwd_num_stages) if backward else \
        (cfg.block_m, cfg.block_n, cfg.num_stages)
    return dict(T=T, NK=NK, HQ=HQ, H=H, DK=dk, DV=dv, BLOCK_DK=pow2(dk), BLOCK_DV=pow2(dv), BLOCK_M=tile[0],
                BLOCK_N=tile[1], SCALE=float(scale), IEEE=bool(q.dtype == jnp.float32), CACHE=lo.ndim == 2,
                num_warps=cfg.num_warps, num_stages=tile[2])


def _check(q, k, v, lo, config):
    """q, k, v as `check_keys` takes them, lo [T] or [B, T], a Config: a ValueError names the argument that does
    not fit."""
    B, T = q.shape[:2]
    check_keys(q, k, v)
    check(lo.shape in ((T,), (B, T)), "lo", f"shape [T] = ({T},) or [B, T] = ({B}, {T})", tuple(lo.shape))
    check(isinstance(config, Config), "config", "a nsa.triton._flash.Config", type(config).__name__)


def _per_batch(x, B):
    """An int32 range end [N] shared by the batch, or [B, N], as the kernels take it: [B, N]."""
    return jnp.broadcast_to(x, (B, x.shape[-1]))


def attend(q, k, v, lo, hi, *, scale, config):
    """o [B, T, HQ, Dv] (q's dtype) and lse [B, T, HQ] float32 of query t over key rows [lo[t], hi[t]] (lo, hi
    int32 [T] shared by the batch, or [B, T] per batch row of a KV cache k, v, whose rows past a sequence are
    never read); config: a Config (its forward fields)."""
    _check(q, k, v, lo, config)
    B, T, HQ, _ = q.shape
    return _launch.launch(
        _fwd_kernel, grid=(cdiv(T, config.block_m), B * HQ),
        inputs=dict(Q=q, K=k, V=v, LO=_per_batch(lo, B), HI=_per_batch(hi, B)),
        outputs=dict(O=_launch.shape_dtype((B, T, HQ, v.shape[3]), q.dtype),
                     LSE=_launch.shape_dtype((B, T, HQ), jnp.float32)),
        **_meta(q, k, v, lo, scale, config, backward=False))


def attend_backward(q, k, v, lo, hi, o, lse, do, dlse=None, *, scale, config):
    """(dq, dk, dv) of `attend`, in q's, k's and v's dtypes; dlse [B, T, HQ] is lse's cotangent or None; config:
    a Config (its backward fields: the dk/dv kernel sums config.splits splits of the queries times
    config.head_splits splits of the query heads)."""
    _check(q, k, v, lo, config)
    B, T, HQ, _ = q.shape
    NK, H = k.shape[1], k.shape[2]
    # the pre-pass: ds = p * (dp - delta), with the lse path folded into delta
    delta = kernel_delta(o, do, q.dtype, lse, dlse)
    do = do.astype(q.dtype)
    meta = _meta(q, k, v, lo, scale, config, backward=True)
    softmax = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, LO=_per_batch(lo, B), HI=_per_batch(hi, B))
    [dq] = _launch.launch(_bwd_dq_kernel, grid=(cdiv(T, config.bwd_block_m), B * HQ), inputs=softmax,
                          outputs=dict(DQ=_launch.shape_dtype(q.shape, q.dtype)), **meta)
    first, last = (_per_batch(x, B) for x in _varlen.query_ranges(lo, hi, NK))
    split_m = _varlen.round_up(cdiv(T, config.splits), config.bwd_block_m)
    splits = cdiv(T, split_m) * config.head_splits
    check(HQ // H % config.head_splits == 0, "config.head_splits", f"a divisor of G = {HQ // H}", config.head_splits)
    part = lambda x: _launch.shape_dtype((splits,) + x.shape, x.dtype if splits == 1 else jnp.float32)
    dk, dv = _launch.launch(
        _bwd_dkdv_kernel, grid=(cdiv(NK, config.bwd_block_n), splits, B * H),
        inputs=dict(softmax, FIRST=first, LAST=last), outputs=dict(DK_OUT=part(k), DV_OUT=part(v)),
        SPLIT_M=split_m, HEAD_SPLITS=config.head_splits, **meta)
    # the splits summed in a fixed order: deterministic
    dk, dv = (functools.reduce(jnp.add, list(x)).astype(y.dtype) for x, y in ((dk, k), (dv, v)))
    return dq, dk, dv
