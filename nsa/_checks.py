"""Trace-time validation of the public arguments.

Every check raises ValueError (wrong shape or value) or TypeError (wrong type or dtype) with a message
that names the argument, what was expected and what was received. Values are checked where they are
known at trace time: a concrete cu_seqlens has its values checked too; a traced one is made valid
(`nsa._varlen.made_valid`), since nothing can be raised from inside a jitted computation.
"""

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from nsa import _families
from nsa._varlen import concrete, made_valid

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _dtype_names(dtypes):
    return ", ".join(jnp.dtype(d).name for d in dtypes)


def _shape(x):
    return tuple(np.shape(x))


def is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")


def array(name, x, ndim, *, dtypes=FLOAT_DTYPES, like=None):
    """Checks that `x` is an array of rank `ndim` with a dtype in `dtypes` (or `like`'s dtype)."""
    if not is_array(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(x)}")
    static_dims(name, x)
    if like is not None and x.dtype != like.dtype:
        raise TypeError(f"{name}.dtype must equal q.dtype ({like.dtype.name}), got {x.dtype.name}")
    if dtypes is not None and x.dtype not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"{name}.dtype must be one of {_dtype_names(dtypes)}, got {x.dtype.name}")


def float_dtype(name, dtype):
    """`dtype` as a NumPy dtype, if it is one of FLOAT_DTYPES (a cache's keys and values)."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be one of {_dtype_names(FLOAT_DTYPES)}, got {dtype!r}") from None
    if dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name} must be one of {_dtype_names(FLOAT_DTYPES)}, got {dtype.name}")
    return dtype


def integer_array(name, x, ndim):
    if not is_array(x):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype.name}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(x)}")


def shape(name, x, expected, description):
    """Checks `x.shape == expected`; `description` names the dims, e.g. '[B, T, HQ]'."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {description} = {tuple(expected)}, got {_shape(x)}")


def _integer_scalar(x):
    """Whether x is a 0-d integer array (NumPy or JAX, concrete or traced)."""
    return is_array(x) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer)


def static_int(name, value):
    """`value` as a Python int: a Python or NumPy integer, or a concrete 0-d integer array."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if _integer_scalar(value):
        known = concrete(value)
        if known is None:
            raise TypeError(f"{name} must be a static int (it sets array shapes), got a traced 0-d "
                            f"{value.dtype.name} array; pass a Python int")
        return int(known)
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def positive_int(name, value):
    value = static_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def stride(stride, block_size):
    """The stride d of compression windows of l = block_size tokens (already checked), as an op takes it (None:
    l, windows that do not overlap): a positive int that divides l."""
    if stride is None:
        return block_size
    stride = positive_int("stride", stride)
    if block_size % stride:
        raise ValueError(f"stride = {stride} must divide block_size = {block_size}: each compressed row is a window "
                         f"of block_size tokens made of whole strides")
    return stride


def compression(block_size, compress_block_size, compress_stride, block_size_default=False):
    """(l, d) of the compression under selection blocks of l' = block_size tokens (already checked; with
    `block_size_default` the call's default, which errors say). l = compress_block_size, default l'. d =
    compress_stride must divide l (a window is made of whole strides) and l' (a selection block is scored by the
    rows it overlaps, in whole strides); its default is the largest stride that does, gcd(l, l'): windows that do
    not overlap (d = l) wherever l divides l', fla's one block for all (l = d = l') and windows smaller than the
    blocks (l = 32 under l' = 64: d = 32) alike, and where l does not (l = 32 over l' = 16) windows overlapping as
    little as they can (d = 16). So no default ever raises, and the paper's overlap (l = 32, d = 16 under
    l' = 64) is one compress_stride away."""
    l = block_size if compress_block_size is None else positive_int("compress_block_size", compress_block_size)
    if compress_stride is None:
        return l, math.gcd(l, block_size)
    d = positive_int("compress_stride", compress_stride)
    if compress_block_size is not None and l % d:
        raise ValueError(f"compress_stride = {d} must divide compress_block_size = {l}: each compressed row is a "
                         f"window of compress_block_size tokens made of whole strides")
    if block_size % d:
        default = " (its default)" if block_size_default else ""
        raise ValueError(f"compress_stride = {d} must divide block_size = {block_size}{default}: a selection block is "
                         f"scored by the compressed rows it overlaps, in whole strides")
    return l, d


def non_negative_int(name, value):
    value = static_int(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def scale(value, head_dim):
    """The softmax scale: head_dim ** -0.5 for None; a float for a number or a concrete 0-d array
    (finite and > 0); a traced 0-d array (a learned temperature) is returned as it is, for the op to
    fold into q."""
    if value is None:
        return float(head_dim) ** -0.5
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    elif is_array(value) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.number) \
            and not jnp.issubdtype(value.dtype, jnp.complexfloating):
        known = concrete(value)
        if known is None:
            return value
        number = float(known)
    else:
        what = f"an array of shape {_shape(value)}" if is_array(value) else type(value).__name__
        raise TypeError(f"scale must be a number, a 0-d real array or None, got {what}")
    if not np.isfinite(number) or number <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {number}")
    return number


def implementation(value):
    """`value` if it names an implementation: None, 'xla', or a family of nsa._families.FAMILIES."""
    names = (None, "xla", *_families.FAMILIES)
    if value not in names:
        raise ValueError(f"implementation must be one of {names}, got {value!r}")
    return value


def qkv(q, k, v):
    """Checks q [B, T, HQ, Dk], k [B, TK, H, Dk], v [B, TK, H, Dv] with TK >= T (the queries are the last T
    tokens of the key sequences); returns (B, T, HQ, H)."""
    array("q", q, 4)
    array("k", k, 4, like=q)
    array("v", v, 4, like=q)
    B, T, HQ, Dk = q.shape
    TK, H = k.shape[1], k.shape[2]
    if TK < T:
        raise ValueError(f"k must have at least as many tokens as q (TK = k.shape[1] >= T = q.shape[1] = {T}: "
                         f"the queries are the last T tokens), got shape {_shape(k)}")
    shape("k", k, (B, TK, H, Dk), "[B, TK, H, Dk] (B, Dk from q)")
    shape("v", v, (B, TK, H, v.shape[3]), "[B, TK, H, Dv] (B from q, TK, H from k)")
    group(HQ, H)
    return B, T, HQ, H


def kv_lens(lens, B, T, TK, cu, bound="TK = k.shape[1]", name="kv_lens"):
    """kv_lens as the ops take it: None, or int32 [B] with T <= kv_lens[b] <= TK (`bound` names TK).

    kv_lens[b] is sequence b's length in a padded KV cache, and the T queries are its last T tokens. None
    stays None, and so does a kv_lens that can only be T (TK = T): the queries are then the whole
    sequences. A concrete kv_lens outside [T, TK] raises ValueError; a traced one is clipped to [T, TK].
    """
    if lens is None:
        return None
    if cu is not None:
        raise ValueError("kv_lens (sequences at the end of a padded KV cache, B >= 1) and cu_seqlens (packed "
                         "sequences, B = 1) cannot be given together; pass one of them")
    lens = lengths(name, lens, B, T, TK, f"[T, {bound}]",
                   " (the T queries are the last tokens of each sequence)")
    return None if TK == T else lens


def ragged_lens(q_lens, kv_lens, B, T, TK, cu, lens_name="kv_lens"):
    """(q_lens, kv_lens) of a ragged step, int32 [B] each: sequence b has kv_lens[b] tokens in [0, TK] (named
    `lens_name`), of which its queries are the last q_lens[b] in [0, min(T, kv_lens[b])]. Concrete ones outside
    raise ValueError, traced ones are clipped; kv_lens is needed (the queries' positions), cu_seqlens refused."""
    if kv_lens is None:
        raise ValueError("q_lens (a ragged step: sequence b's queries are the first q_lens[b] rows of q) needs the "
                         "sequences' lengths: pass cache= or kv_lens=")
    if cu is not None:
        raise ValueError("q_lens (a ragged step over a batch of KV caches) and cu_seqlens (packed sequences, B = 1) "
                         "cannot be given together; pass one of them")
    kv_lens = lengths(lens_name, kv_lens, B, 0, TK, "[0, TK = k.shape[1]]")
    q_lens = lengths("q_lens", q_lens, B, 0, T, "[0, T = q.shape[1]]")
    most, wanted = concrete(kv_lens), concrete(q_lens)
    if most is None or wanted is None:
        return jnp.minimum(q_lens, kv_lens), kv_lens
    if np.any(wanted > most):
        b = int(np.argmax(wanted > most))
        raise ValueError(f"q_lens[{b}] = {wanted[b]} queries must be tokens of sequence {b}, which has "
                         f"{lens_name}[{b}] = {most[b]} (append the new tokens to the cache first)")
    return q_lens, kv_lens


def lengths(name, lens, B, lo, hi, bounds, why=""):
    """Per-sequence lengths `name` (an int array [B], list or tuple) as int32 [B]: concrete ones must lie in
    [lo, hi] (else a ValueError that names the range as `bounds`, then `why`), traced ones are clipped to it."""
    if isinstance(lens, (list, tuple)):
        lens = np.asarray(lens)
    integer_array(name, lens, 1)
    shape(name, lens, (B,), "[B]")
    values = concrete(lens)
    if values is None:
        return jnp.clip(lens.astype(jnp.int32), lo, hi)
    bad = (values < lo) | (values > hi)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"{name} must lie in {bounds} = [{lo}, {hi}]{why}, got {name}[{i}] = {values[i]}")
    return jnp.asarray(values, jnp.int32)


def group(HQ, H):
    if H == 0 or HQ % H:
        raise ValueError(f"the query heads HQ (q.shape[2] = {HQ}) must be a multiple of the key/value "
                                          f"heads H (k.shape[2] = {H})")


def gate(name, g, B, T, HQ):
    if g is None:
        return
    if not is_array(g):
        raise TypeError(f"{name} must be an array or None, got {type(g).__name__}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {g.dtype.name}")
    shape(name, g, (B, T, HQ), "[B, T, HQ]")


def cu_seqlens(cu, B, T):
    """cu_seqlens as the ops take it (None stays None; a list or tuple becomes a NumPy array).

    A concrete cu_seqlens must start at 0, never decrease (empty sequences are allowed) and end at T;
    a traced one is made valid (`made_valid`).
    """
    if cu is None:
        return None
    if isinstance(cu, (list, tuple)):
        cu = np.asarray(cu)
    integer_array("cu_seqlens", cu, 1)
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1 sequences, got {_shape(cu)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs the sequences along T and needs batch size B = 1, got B = {B}")
    values = concrete(cu)
    if values is None:
        return made_valid(cu, T)
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {values[0]}")
    steps = np.diff(values)
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0))
        raise ValueError(f"cu_seqlens must not decrease, got cu_seqlens[{i}] = {values[i]} > "
                         f"cu_seqlens[{i + 1}] = {values[i + 1]}")
    if values[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T}, got cu_seqlens[-1] = {values[-1]}")
    return cu


def block_indices(idx, B, T, H):
    integer_array("block_indices", idx, 4)
    if tuple(idx.shape[:3]) != (B, T, H):
        raise ValueError(f"block_indices must have shape [B, T, H, S] with [B, T, H] = {(B, T, H)}, "
                                          f"got {_shape(idx)}")


def block_counts(counts, B, T, H, most):
    """block_counts as the ops take it, capped at `most`, the slots a query can use (a larger count uses them all,
    as `most` does, and costs no more): a Python int in [0, most] (from any integer scalar, NumPy or a concrete
    0-d array), or an int32 array, [B, T, H] or a traced 0-d one, its values capped (a concrete one stays a
    NumPy array, whose max can set the number of slots)."""
    if is_array(counts) and counts.ndim > 0:
        integer_array("block_counts", counts, 3)
        shape("block_counts", counts, (B, T, H), "[B, T, H]")
    elif not (_integer_scalar(counts) and concrete(counts) is None):
        return min(non_negative_int("block_counts", counts), most)
    most = min(most, int(jnp.iinfo(counts.dtype).max))  # in counts' dtype
    values = concrete(counts)
    if values is None:
        return jnp.minimum(counts, most).astype(jnp.int32)
    return np.minimum(values, most).astype(np.int32)


# The dimensions of the arrays `array` checks, by the name the ops give them.
_DIM_NAMES = {"q": ("B", "T", "HQ", "Dk"), "k": ("B", "TK", "H", "Dk"), "v": ("B", "TK", "H", "Dv"),
              "x": ("B", "T", "H", "D"), "k_cmp": ("B", "NC", "H", "Dk"), "v_cmp": ("B", "NC", "H", "Dv"),
              "cache.k": ("B", "N", "H", "Dk"), "cache.v": ("B", "N", "H", "Dv"), "cache.k_cmp": ("B", "NC", "H", "Dk"),
              "cache.v_cmp": ("B", "NC", "H", "Dv")}


def static_dims(name, x):
    """Checks that every dimension of x but its batch (axis 0) is static. Under jax.export's shape polymorphism
    only the batch may be a symbolic dimension: the others set the kernels' tiles and grids and nsa's block
    arithmetic (Python ints)."""
    for axis in range(1, x.ndim):
        if jax.export.is_symbolic_dim(x.shape[axis]):
            names = _DIM_NAMES.get(name, ())
            which = f" ({names[axis]})" if len(names) == x.ndim else ""
            raise ValueError(f"{name}.shape[{axis}]{which} must be static: under jax.export's shape polymorphism "
                             f"only the batch (axis 0) may be symbolic, since the other dimensions set the kernels' "
                             f"tiles and nsa's block arithmetic; got the symbolic dimension '{x.shape[axis]}'")
