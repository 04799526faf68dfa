"""The one convention of every kernel's tile configuration, in every family.

Each kernel module has one `Config`, a NamedTuple decorated with `@validated`: a Config is checked when it is
made (its `check` method raises ValueError naming the field, what was expected and what it got), so that no
kernel ever runs on a config it cannot take. Each has one `default_config(shapes, dtype, device)`:

- `shapes`: the `Shapes` of the call (`Shapes.of(q, k, v, ...)`),
- `dtype`: the inputs' dtype,
- `device`: the `nsa._device.Device` it plans for (`nsa._device.facts(platform)`),

whose comment points to the measurement that chose it (a file of benchmarks/results). A kernel's forward and
backward take `config=None` (then `default_config`'s) or a Config; what a config cannot say (whether to run the
decode kernels) is an explicit argument of its own. The public API takes no config.

A family's `Claim` on some inputs of another's op (nsa._families: `claims`) is here too, with `wanted`, which a
backward whose gradients can be claimed apart asks.
"""

from typing import Callable, NamedTuple, Optional

import jax

from nsa._plan import blocks_of, one_row_per_block


class Shapes(NamedTuple):
    """The sizes a default_config plans with (a dim may be symbolic under jax.export: B, for kernels that map over
    it): q [B, T, HQ, Dk] against k [B, TK, H, Dk] and v [B, TK, H, Dv]
    (for the compressed branch TK is the compressed rows' count), with the op's own sizes where it has them."""
    B: int
    T: int
    TK: int
    HQ: int
    H: int
    Dk: int
    Dv: int
    block_size: int = 0  # the selection or compression block (0: none)
    block_counts: int = 0  # S: the selected blocks per query (0: none)
    window_size: int = 0
    packed: bool = False  # cu_seqlens given: B = 1 holds several sequences
    compress_stride: int = 0  # the selection's compressed rows: one every compress_stride tokens (0: block_size)
    compress_block_size: int = 0  # ... each a window of compress_block_size tokens (0: block_size)

    @property
    def one_row_per_block(self):
        """Whether a selection block scores one compressed row (windows of block_size every block_size)."""
        return one_row_per_block(*blocks_of(self.block_size, self.compress_block_size or None,
                                            self.compress_stride or None))

    @property
    def G(self):
        return self.HQ // self.H

    @classmethod
    def of(cls, q, k, v=None, **sizes):
        """The Shapes of q, k and v (v defaults to k), plus `sizes` (block_size, block_counts, window_size,
        packed)."""
        v = k if v is None else v
        return cls(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], **sizes)


class Step(NamedTuple):
    """The arrays of one serving step of nsa.attention, as the fused step (`attention`) takes them: the queries
    q [B, TQ, HQ, Dk] at the end of the cache k [B, TK, H, Dk], v [B, TK, H, Dv], its compressed rows k_cmp
    [B, NC, H, Dk] and v_cmp [B, NC, H, Dv], the gates [B, TQ, HQ] (None: weight 1) and kv_lens int [B]. A paged
    cache (nsa.PagedKVCache) adds its page_table int32 [B, MP]: k, v, k_cmp and v_cmp are then its pools of pages
    ([P, S, H, D] and [P, S / d, H, D]), each sequence's rows found through the table (`as_sequences`). A ragged
    step adds q_lens int [B]: sequence b's queries are the first q_lens[b] rows of q, its last q_lens[b] tokens (at
    positions kv_lens[b] - q_lens[b] + t); the other rows are padding, their output 0."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    k_cmp: jax.Array
    v_cmp: jax.Array
    g_cmp: Optional[jax.Array]
    g_slc: Optional[jax.Array]
    g_swa: Optional[jax.Array]
    kv_lens: jax.Array
    page_table: Optional[jax.Array] = None
    q_lens: Optional[jax.Array] = None


def as_sequences(x, page_table):
    """x [B, N, H, D] as each sequence sees it: x itself, or with a page table int [B, MP] the pool of pages x
    [P, S, H, D] seen as a jax.ShapeDtypeStruct [B, MP * S, H, D] (its pages in each sequence's order)."""
    if page_table is None:
        return x
    return jax.ShapeDtypeStruct((page_table.shape[0], page_table.shape[1] * x.shape[1], *x.shape[2:]), x.dtype)


def validated(cls):
    """Class decorator for a kernel's Config NamedTuple: every instance, made directly, by `_make` or by
    `_replace`, is checked by the class's `check(self)` method."""
    new = cls.__new__

    def checked(klass, *args, **kwargs):
        config = new(klass, *args, **kwargs)
        config.check()
        return config

    cls.__new__ = checked
    cls._make = classmethod(lambda klass, iterable: klass(*iterable))
    return cls


def expect(ok, config, field, wanted):
    """Raises ValueError saying `config`'s `field` must be `wanted`, unless ok."""
    if not ok:
        raise ValueError(f"{type(config).__module__}.{type(config).__name__}.{field}: expected {wanted}, got "
                         f"{getattr(config, field)!r}")


def positive(config, *fields):
    for field in fields:
        value = getattr(config, field)
        expect(isinstance(value, int) and value > 0, config, field, "a positive int")


def power_of_two(config, *fields):
    for field in fields:
        value = getattr(config, field)
        expect(isinstance(value, int) and value > 0 and value & (value - 1) == 0, config, field, "a power of two")


class Claim(NamedTuple):
    """A family's claim on some inputs of one phase of an op (nsa._families' `claims`).

    test: the phase's arguments (with its static keywords) -> a traced bool where the claiming kernel runs, or a
    static False or True (the arguments' shapes or dtypes, or the static configuration, decide alone). grads: for a
    backward, the gradients (indices of its result) the claiming kernel computes where the test holds, while the
    preferred family computes `rest`; None: the whole phase."""

    test: Callable
    grads: Optional[tuple] = None
    rest: Optional[tuple] = None


def wanted(grads, *indices):
    """Whether a backward called with `grads` (a Claim's grads or rest; None: all) computes any of these
    gradients."""
    return grads is None or any(i in grads for i in indices)
