"""Property test: random partitions (with empty segments), chunk sizes and partition forms."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from helpers import (
    SHIFTS,
    Partition,
    apply,
    assert_allclose,
    check_each,
    data_scale,
    jit_each,
    permute_rows,
    reference,
    segment_data,
)
from hypothesis import given, settings
from hypothesis import strategies as st

NAMES = ("logsumexp", "sum")


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    chunk_size=st.one_of(st.none(), st.integers(1, 20)),
    form=st.sampled_from(["sizes", "offsets", "unsorted_ids", "jit_sizes", "jit_sorted_ids"]),
    features=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_logsumexp_and_sum_match_reference(sizes, chunk_size, form, features, seed):
    rng = np.random.default_rng(seed)
    part = Partition(np.asarray(sizes, np.int64))
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=features, shifts=SHIFTS)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(NAMES, lambda n, x: apply(n, x, ids, s, form, chunk_size=chunk_size))(
        jnp.asarray(x)
    )

    def check(name):
        assert outs[name].shape == (s, *features)
        ref = reference(name, x, ids, s)
        assert_allclose(outs[name], ref, dtype=np.float32, scale=data_scale(x))

    check_each(NAMES, check)
