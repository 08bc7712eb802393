"""Bad inputs raise ValueError/TypeError naming the public function and the offending argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ALL, INT_OK, PUBLIC_NAMES, op

X = jnp.arange(6.0, dtype=jnp.float32)  # N = 6
SIZES = [2, 0, 4]


def _raises(name, exc, *argnames, call):
    """``call()`` raises ``exc`` whose message names ``foldax.segment_<name>`` and ``argnames``."""
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert PUBLIC_NAMES[name] in msg, msg
    for arg in argnames:
        assert arg in msg, f"{arg!r} not in {msg!r}"
    return msg


BAD_PARTITIONS = {
    "sizes_sum_too_small": (ValueError, "sizes", {"sizes": [2, 0, 3]}),
    "sizes_sum_too_large": (ValueError, "sizes", {"sizes": [2, 1, 4]}),
    "sizes_negative": (ValueError, "sizes", {"sizes": [4, -1, 3]}),
    "sizes_numpy_negative": (ValueError, "sizes", {"sizes": np.array([7, -1])}),
    "sizes_float": (TypeError, "sizes", {"sizes": [2.0, 4.0]}),
    "sizes_float_array": (TypeError, "sizes", {"sizes": jnp.array([2.0, 4.0])}),
    "sizes_2d": (ValueError, "sizes", {"sizes": np.array([[2, 4]])}),
    "offsets_decreasing": (ValueError, "offsets", {"offsets": [0, 4, 2, 6]}),
    "offsets_not_from_0": (ValueError, "offsets", {"offsets": [1, 3, 6]}),
    "offsets_not_to_n": (ValueError, "offsets", {"offsets": [0, 3, 5]}),
    "offsets_past_n": (ValueError, "offsets", {"offsets": [0, 3, 7]}),
    "no_partition": (ValueError, "segment_ids", {}),
    "sizes_and_offsets": (ValueError, "offsets", {"sizes": SIZES, "offsets": [0, 2, 2, 6]}),
    "ids_and_sizes": (
        ValueError,
        "sizes",
        {"segment_ids": jnp.zeros(6, jnp.int32), "sizes": SIZES},
    ),
    "float_segment_ids": (TypeError, "segment_ids", {"segment_ids": jnp.zeros(6, jnp.float32)}),
    "segment_ids_wrong_length": (
        ValueError,
        "segment_ids",
        {"segment_ids": jnp.zeros(5, jnp.int32)},
    ),
    "num_segments_disagrees": (ValueError, "num_segments", {"sizes": SIZES, "num_segments": 4}),
    "num_segments_negative": (
        ValueError,
        "num_segments",
        {"segment_ids": jnp.zeros(6, jnp.int32), "num_segments": -1},
    ),
    "num_segments_float": (
        TypeError,
        "num_segments",
        {"segment_ids": jnp.zeros(6, jnp.int32), "num_segments": 2.0},
    ),
    "chunk_size_zero": (ValueError, "chunk_size", {"sizes": SIZES, "chunk_size": 0}),
    "chunk_size_negative": (ValueError, "chunk_size", {"sizes": SIZES, "chunk_size": -4}),
    "chunk_size_float": (TypeError, "chunk_size", {"sizes": SIZES, "chunk_size": 4.0}),
}


@pytest.mark.parametrize("case", list(BAD_PARTITIONS))
@pytest.mark.parametrize("name", ALL)
def test_bad_partition_arguments(name, case):
    exc, arg, kwargs = BAD_PARTITIONS[case]
    _raises(name, exc, arg, call=lambda: op(name)(X, **kwargs))


@pytest.mark.parametrize("name", ["sum", "softmax"])
def test_empty_offsets_list(name):
    _raises(name, ValueError, "offsets", call=lambda: op(name)(X, offsets=[]))


@pytest.mark.parametrize("name", ALL)
def test_static_sizes_still_checked_under_jit(name):
    _raises(name, ValueError, "sizes", call=lambda: jax.jit(lambda x: op(name)(x, sizes=[1, 2]))(X))


@pytest.mark.parametrize("name", ALL)
def test_traced_segment_ids_need_num_segments(name):
    ids = jnp.array([0, 0, 1, 1, 2, 2])
    f = jax.jit(lambda x, i: op(name)(x, i))
    _raises(name, ValueError, "num_segments", "segment_ids", call=lambda: f(X, ids))


@pytest.mark.parametrize("name", ALL)
def test_traced_num_segments(name):
    ids = jnp.array([0, 0, 1, 1, 2, 2])
    f = jax.jit(lambda x, s: op(name)(x, ids, s))
    _raises(name, TypeError, "num_segments", call=lambda: f(X, 3))


@pytest.mark.parametrize("name", ALL)
def test_fn_wrong_leading_size(name):
    _raises(name, ValueError, "fn", call=lambda: op(name)(X, sizes=SIZES, fn=lambda r: r[:1]))
    _raises(name, ValueError, "fn", call=lambda: op(name)(X, sizes=SIZES, fn=lambda r: jnp.sum(r)))


@pytest.mark.parametrize("name", ALL)
def test_fn_not_callable_or_not_an_array(name):
    _raises(name, TypeError, "fn", call=lambda: op(name)(X, sizes=SIZES, fn=3))
    _raises(name, TypeError, "fn", call=lambda: op(name)(X, sizes=SIZES, fn=lambda r: (r, r)))


@pytest.mark.parametrize("name", ALL)
def test_fn_taking_the_parts_of_a_tuple_separately(name):
    # fn gets the chunk as one pytree, as lax.map's f does: fn(x, lp) for data (x, lp) is told
    pair = (X, 2 * X)
    msg = _raises(
        name,
        TypeError,
        "fn",
        "*rows",
        call=lambda: op(name)(pair, sizes=SIZES, fn=lambda x, lp: x - lp),
    )
    assert "2 separate parameters" in msg, msg
    got = op(name)(pair, sizes=SIZES, fn=lambda rows, scale=1.0: scale * (rows[0] - rows[1]))
    want = op(name)(-X, sizes=SIZES)
    # assert_allclose takes NaN == NaN: only the mean of no values, exp's, is NaN
    nan = np.asarray(SIZES) == 0 if name == "logmeanexp" else np.zeros(np.shape(want), bool)
    np.testing.assert_array_equal(np.isnan(np.asarray(want)), nan)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("name", ALL)
def test_bad_data(name):
    ids = jnp.zeros(6, jnp.int32)  # a leading size neither N nor 1: jax.ops rejects it too
    _raises(name, ValueError, "data", call=lambda: op(name)(jnp.ones(3, jnp.float32), ids, 1))
    _raises(name, ValueError, "data", call=lambda: op(name)(X[0], sizes=SIZES, fn=lambda r: r))
    tree = {"a": jnp.zeros(6, jnp.float32), "b": jnp.zeros(5, jnp.float32)}
    _raises(name, ValueError, "data", call=lambda: op(name)(tree, sizes=SIZES, fn=lambda r: r["a"]))
    tree = {"a": X, "b": X}
    _raises(name, TypeError, "fn", call=lambda: op(name)(tree, sizes=SIZES))


@pytest.mark.parametrize("name", ALL)
def test_complex_data_rejected_except_by_sum_and_mean(name):
    z = X.astype(jnp.complex64)
    if name == "mean":
        np.testing.assert_allclose(op(name)(z, sizes=SIZES), [0.5, 0.0, 3.5])
        return
    if name == "sum":
        np.testing.assert_allclose(op(name)(z, sizes=SIZES), [1.0, 0.0, 14.0])
        return
    _raises(name, TypeError, "data", call=lambda: op(name)(z, sizes=SIZES))


@pytest.mark.parametrize("name", ALL)
def test_int_data_needs_float_except_sum_max_min(name):
    xi = jnp.arange(6, dtype=jnp.int32)
    if name in INT_OK:
        out = op(name)(xi, sizes=SIZES)
        assert out.dtype == jnp.int32
        # ... and float data is of course fine for them too
        assert op(name)(X, sizes=SIZES).dtype == jnp.float32
        return
    _raises(name, TypeError, "data", call=lambda: op(name)(xi, sizes=SIZES))
    # the values reduced are fn's: an int fn output is named as such
    _raises(
        name,
        TypeError,
        "fn",
        call=lambda: op(name)(X, sizes=SIZES, fn=lambda r: r.astype(jnp.int32)),
    )
