"""Global batch i is the same samples under any data-parallel size and micro-batch size."""

from __future__ import annotations

import pytest

from megatron_lite.data.samplers import micro_batch_indices


@pytest.mark.parametrize("dp,mbs", [(1, 8), (1, 1), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_global_batch_is_layout_independent(dp, mbs):
    gbs = 8
    for it in range(3):
        got = sorted(i for r in range(dp) for ix in micro_batch_indices(it * gbs, gbs, mbs, r, dp) for i in ix)
        assert got == list(range(it * gbs, (it + 1) * gbs))
        per_rank = [len(micro_batch_indices(it * gbs, gbs, mbs, r, dp)) for r in range(dp)]
        assert per_rank == [gbs // (mbs * dp)] * dp  # every rank runs the same number of micro-batches


def test_uneven_batch_refused():
    with pytest.raises(ValueError):
        micro_batch_indices(0, 10, 2, 0, 4)
