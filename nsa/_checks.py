"""Trace-time validation of the public arguments.

Every check raises ValueError (wrong shape or value) or TypeError (wrong type or dtype) with a message
that names the argument, what was expected and what was received. Only what can be seen at trace time
is checked here; `nsa.check_cu_seqlens` checks the values of a concrete `cu_seqlens`.
"""

import numbers

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
IMPLEMENTATIONS = (None, "xla", "triton", "pallas")


def _dtype_names(dtypes):
    return ", ".join(jnp.dtype(d).name for d in dtypes)


def _shape(x):
    return tuple(np.shape(x))


def array(name, x, ndim, *, dtypes=FLOAT_DTYPES, like=None):
    """Checks that `x` is an array of rank `ndim` with a dtype in `dtypes` (or `like`'s dtype)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(x)}")
    if like is not None and x.dtype != like.dtype:
        raise TypeError(f"{name}.dtype must equal q.dtype ({like.dtype.name}), got {x.dtype.name}")
    if dtypes is not None and x.dtype not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"{name}.dtype must be one of {_dtype_names(dtypes)}, got {x.dtype.name}")


def integer_array(name, x, ndim):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype.name}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(x)}")


def shape(name, x, expected, description):
    """Checks `x.shape == expected`; `description` names the dims, e.g. '[B, T, HQ]'."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {description} = {tuple(expected)}, got {_shape(x)}")


def positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value)


def non_negative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def scale(value, head_dim):
    """Returns the softmax scale: `value`, or head_dim ** -0.5 when it is None."""
    if value is None:
        return float(head_dim) ** -0.5
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scale must be a Python float or None, got {type(value).__name__}")
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {value}")
    return float(value)


def implementation(value):
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {value!r}")
    return value


def qkv(q, k, v):
    """Checks q [B, T, HQ, Dk], k [B, T, H, Dk], v [B, T, H, Dv]; returns (B, T, HQ, H)."""
    array("q", q, 4)
    array("k", k, 4, like=q)
    array("v", v, 4, like=q)
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    shape("k", k, (B, T, H, Dk), "[B, T, H, Dk] (B, T, Dk from q)")
    shape("v", v, (B, T, H, v.shape[3]), "[B, T, H, Dv] (B, T from q, H from k)")
    group(HQ, H)
    return B, T, HQ, H


def group(HQ, H):
    if H == 0 or HQ % H:
        raise ValueError(f"the query heads HQ (q.shape[2] = {HQ}) must be a multiple of the key/value "
                                          f"heads H (k.shape[2] = {H})")


def gate(name, g, B, T, HQ):
    if g is None:
        return
    if not hasattr(g, "shape") or not hasattr(g, "dtype"):
        raise TypeError(f"{name} must be an array or None, got {type(g).__name__}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {g.dtype.name}")
    shape(name, g, (B, T, HQ), "[B, T, HQ]")


def cu_seqlens(cu, B):
    if cu is None:
        return
    integer_array("cu_seqlens", cu, 1)
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1 sequences, got {_shape(cu)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs the sequences along T and needs batch size B = 1, got B = {B}")


def block_indices(idx, B, T, H):
    integer_array("block_indices", idx, 4)
    if tuple(idx.shape[:3]) != (B, T, H):
        raise ValueError(f"block_indices must have shape [B, T, H, S] with [B, T, H] = {(B, T, H)}, "
                                          f"got {_shape(idx)}")


def block_counts(counts, B, T, H):
    """An int >= 0 or an integer array [B, T, H]."""
    if hasattr(counts, "shape"):
        integer_array("block_counts", counts, 3)
        shape("block_counts", counts, (B, T, H), "[B, T, H]")
        return
    non_negative_int("block_counts", counts)
