"""Which samples each rank reads: global batch i is samples [i * gbs, (i + 1) * gbs) of the (shuffled)
dataset whatever the data-parallel size and micro-batch size, so a run's data does not depend on its
layout, and a resumed run continues with exactly the next samples.

Within a global batch, micro-step m covers samples [m * mbs * dp, (m + 1) * mbs * dp) and data-parallel
rank r takes its [r * mbs, (r + 1) * mbs) slice (Megatron's pretraining sampler order)."""

from __future__ import annotations


def micro_batch_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Sample indices of each micro-batch this rank runs in the global batch starting at
    `consumed_samples`."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(f"global batch {global_batch_size} is not a multiple of {micro_batch_size} x {dp_size}")
    out = []
    for m in range(global_batch_size // per_step):
        start = consumed_samples + m * per_step + dp_rank * micro_batch_size
        out.append(list(range(start, start + micro_batch_size)))
    return out
