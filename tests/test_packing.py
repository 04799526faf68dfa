"""nsa.packing: a padded batch packed with its mask attends as each row alone would, segment ids and cu_seqlens
convert both ways, and malformed inputs raise naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from tests.base import assert_close

B, T, HQ, H, D = 4, 24, 4, 2, 8
KW = dict(block_counts=2, block_size=4, window_size=5, implementation="xla")
# rows: a prompt with padding after it, a full row, an empty row, tokens with holes (padding inside the row)
MASK = np.array([[1] * 15 + [0] * 9, [1] * T, [0] * T, [0, 1, 1, 0, 1, 1, 1, 0] * 3], bool)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return normal(B, T, HQ, D), normal(B, T, H, D), normal(B, T, H, D), jax.nn.sigmoid(normal(B, T, HQ))


def _packed_attention(q, k, v, g, mask):
    cu = nsa.cu_seqlens_from_mask(mask)
    o = nsa.attention(*(nsa.pack(x, mask) for x in (q, k, v)), g_cmp=nsa.pack(g, mask), cu_seqlens=cu, **KW)
    return nsa.unpack(o, mask)


def test_a_packed_padded_batch_attends_as_each_row_alone():
    """pack, attention with cu_seqlens_from_mask, unpack: each row's tokens get what nsa.attention gives on that
    row's tokens alone (the padding removed), eager and under jit (a traced mask); the padding gets zeros, and
    no gradient reaches the padding's inputs."""
    q, k, v, g = _inputs()
    got = _packed_attention(q, k, v, g, MASK)
    jitted = jax.jit(_packed_attention)(q, k, v, g, jnp.asarray(MASK))
    for b in range(B):
        keep = np.flatnonzero(MASK[b])
        np.testing.assert_array_equal(np.asarray(got[b, ~MASK[b]]), 0.0)
        if keep.size:
            one = lambda x: x[b:b + 1, keep]
            alone = nsa.attention(one(q), one(k), one(v), g_cmp=one(g), **KW)[0]
            assert_close(got[b, keep], alone, 1e-6, f"row {b}")
            assert_close(jitted[b, keep], alone, 1e-6, f"row {b} under jit")
    dq, dk = jax.grad(lambda q, k: _packed_attention(q, k, v, g, MASK).sum(), argnums=(0, 1))(q, k)
    assert np.all(np.asarray(dq)[~MASK] == 0) and np.all(np.asarray(dk)[~MASK] == 0)
    assert np.abs(np.asarray(dq)[MASK]).max() > 0


def test_the_mask_layout():
    """cu_seqlens [B + 2]: the rows' sequences, then the padding's; an integer attention_mask works like a bool one."""
    cu = nsa.cu_seqlens_from_mask(MASK.astype(np.int32))
    np.testing.assert_array_equal(cu, [0, 15, 39, 39, 54, B * T])
    x = jnp.arange(B * T, dtype=jnp.float32).reshape(B, T)[..., None]
    packed = nsa.pack(x, MASK)
    np.testing.assert_array_equal(packed[0, :54, 0], np.flatnonzero(MASK))  # the tokens, row after row
    np.testing.assert_array_equal(packed[0, 54:], 0.0)
    np.testing.assert_array_equal(nsa.unpack(packed, MASK), np.where(MASK[..., None], x, 0))


def test_segment_ids_and_cu_seqlens_convert_both_ways():
    ids = np.array([[7, 7, 7, 2, 2, 0, 5, 5, 5, 5]])  # runs of equal ids, in any labelling
    cu = nsa.cu_seqlens_from_segment_ids(ids)
    np.testing.assert_array_equal(cu, [0, 3, 5, 6, 10])
    np.testing.assert_array_equal(nsa.segment_ids_from_cu_seqlens(cu, 10), [0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(nsa.cu_seqlens_from_segment_ids(nsa.segment_ids_from_cu_seqlens(cu, 10)), cu)
    # under jit num_segments sets the length: fewer runs leave empty sequences at the end
    traced = jax.jit(lambda s: nsa.cu_seqlens_from_segment_ids(s, num_segments=6))(jnp.asarray(ids[0]))
    np.testing.assert_array_equal(traced, [0, 3, 5, 6, 10, 10, 10])
    # an empty sequence has no token: its successor's tokens follow it
    np.testing.assert_array_equal(nsa.segment_ids_from_cu_seqlens([0, 2, 2, 4], 4), [0, 0, 2, 2])


@pytest.mark.parametrize("call, error, message", [
    (lambda: nsa.cu_seqlens_from_mask(np.ones((2, 3, 1), bool)), ValueError, r"mask must have 2 dimensions"),
    (lambda: nsa.cu_seqlens_from_mask(np.ones((2, 3), np.float32)), TypeError,
     r"mask must have a bool or integer dtype \(nonzero: a token\), got float32"),
    (lambda: nsa.pack(jnp.zeros((2, 4, 3)), MASK), ValueError,
     r"x must have shape \[B, T, ...\] \(B, T from mask\) = \(4, 24\) \+ \(...\), got \(2, 4, 3\)"),
    (lambda: nsa.unpack(jnp.zeros((1, 95, 3)), MASK), ValueError, r"x must have shape \[1, B \* T, ...\].*got \(1, 95, 3\)"),
    (lambda: jax.jit(nsa.cu_seqlens_from_segment_ids)(jnp.zeros(4, jnp.int32)), ValueError,
     r"segment_ids is traced: pass num_segments"),
    (lambda: nsa.cu_seqlens_from_segment_ids([1, 2, 3], num_segments=2), ValueError,
     r"segment_ids holds 3 sequences \(runs of equal ids\), more than num_segments = 2"),
    (lambda: nsa.segment_ids_from_cu_seqlens([0, 3, 2], 2), ValueError, r"cu_seqlens must not decrease"),
])
def test_bad_inputs_raise(call, error, message):
    with pytest.raises(error, match=message):
        call()
