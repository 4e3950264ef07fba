"""--log-num-zeros-in-grad leaves the vocabulary's padding out, so every layout counts what one process counts:
--vocab-size 100 (101 with the end-of-document token) is padded to 128 on one process and to 256 at TP=2. From a
walk through the docs: TP=2 counted 4960 zeros for one process's 864, all of them padding. Each optimizer finds
the padding in its own part of a parameter: whole TP shards, the distributed optimizer's flat ranges, FSDP2's
row chunks."""

from __future__ import annotations

import json

ARGS = (
    "--mock-data --vocab-size 100 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--train-iters 2 --global-batch-size 8 --lr 3e-3 --log-interval 1 --eval-iters 0 --hidden-dropout 0 "
    "--attention-dropout 0 --untie-embeddings-and-output-weights --distributed-backend gloo --log-num-zeros-in-grad"
).split()


def _zeros(path) -> list[int]:
    return [r["num_zeros_in_grad"] for r in map(json.loads, path.read_text().splitlines())]


def test_every_layout_counts_the_zeros_of_one_process(tmp_path, pretrain_job):
    pretrain_job(1, [*ARGS, "--micro-batch-size", "8", "--log-jsonl", str(tmp_path / "one.jsonl")])
    one = _zeros(tmp_path / "one.jsonl")
    assert all(z > 0 for z in one)
    for name, n, extra in (
        ("tp2", 2, "--micro-batch-size 8 --tensor-model-parallel-size 2"),
        # (the ranges split the embedding's rows between the two data-parallel ranks)
        ("tp2_distopt", 4, "--micro-batch-size 4 --tensor-model-parallel-size 2 --use-distributed-optimizer"),
        ("tp2_fsdp2", 4, "--micro-batch-size 4 --tensor-model-parallel-size 2 --use-torch-fsdp2"),
    ):
        pretrain_job(n, [*ARGS, *extra.split(), "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        got = _zeros(tmp_path / f"{name}.jsonl")
        # (within one row's 32 entries: an entry may sum to exactly 0.0 in one order of additions, not another)
        assert all(abs(a - b) < 32 for a, b in zip(one, got)) and len(got) == len(one), (name, one, got)


def test_the_padding_in_any_flat_range_of_a_shard():
    """padding_in against the padding shard() writes (zeros where the full tensor is ones), over every flat range
    a distributed optimizer or FSDP2 could give a rank, for a vocabulary split over TP and a two-block one."""
    import torch

    from megatron_lite.optimizer.optimizer import padding_in
    from megatron_lite.parameters import ParamMeta
    from megatron_lite.tensor_parallel.sharding import ShardSpec

    for spec, full in ((ShardSpec(0, (101,), (128,), 2), (101, 3)), (ShardSpec(1, (5, 3), (8, 4), 4), (2, 8, 3))):
        for rank in range(spec.tp_size):
            ones = spec.shard(torch.ones(full), rank)
            pad = (ones == 0).flatten()
            n = pad.numel()
            meta = ParamMeta(shard=spec, shard_rank=rank)
            assert padding_in(meta, tuple(ones.shape)) == int(pad.sum())
            for lo in range(0, n, 7):
                for hi in range(lo, n + 1, 5):
                    assert padding_in(meta, tuple(ones.shape), lo, hi) == int(pad[lo:hi].sum()), (spec, rank, lo, hi)
