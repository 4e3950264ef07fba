"""Megatron's --reset-position-ids and --reset-attention-mask: documents packed into one sample are trained as
if each were alone.

- The ids follow Megatron's definition (`_get_ltor_masks_and_position_ids`): an end-of-document token belongs
  to the document it ends; the next document starts after it, at position 0, seeing only itself.
- The independent check: a packed sample [A EOD B] gives each document's tokens the loss, and each weight the
  gradient, of that document run alone (torch and Triton kernels; learned positions and RoPE; recomputation).
- Training equals one process under TP=2 + SP, PP=2 and DP=2 with the distributed optimizer (1e-4), on an
  indexed dataset of short documents, where the flags change the run.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_train_equivalence import _compare, train_run

from megatron_lite import kernels as K
from megatron_lite.config import ParallelConfig
from megatron_lite.data.documents import document_ids, document_position_ids
from megatron_lite.models.gpt_model import build_model
from megatron_lite.parallel_context import ParallelContext

from models import CONFIGS

P = ParallelConfig
EOD = 9


def test_ids_follow_megatron():
    # documents [5 4 EOD] [7 EOD] [EOD] [3 4]: worked out by hand from Megatron's loop, which for each EOD at
    # index i masks keys <= i from queries > i and subtracts i + 1 - (previous document start) from later positions
    tokens = torch.tensor([[5, 4, EOD, 7, EOD, EOD, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert document_position_ids(tokens, EOD).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def _loss_and_grads(model, tokens, labels, positions, documents, weight):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, labels=labels, document_ids=documents)
    (loss * weight).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {  # model, kernels, recomputation
    "llama": ("llama", "torch", None),
    "llama-triton": ("llama", "triton", None),
    "llama-selective": ("llama", "torch", "selective"),
    "llama-full": ("llama", "torch", "full"),
    "gpt2": ("gpt2", "torch", None),  # learned absolute positions
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_document_trains_as_if_alone(case):
    """Two rows, each two documents with the boundary at another place: the second documents' losses, and the
    gradients of their summed loss, equal those of each run alone; the first documents' losses likewise."""
    name, impl, recompute = CASES[case]
    kw = {"recompute_granularity": recompute} if recompute else {}
    if recompute == "full":
        kw.update(recompute_method="uniform", recompute_num_layers=1)
    config = CONFIGS[name](num_layers=2, kernel_impl=impl, **kw)
    model = build_model(config, ParallelContext.virtual(P(), device=torch.device("cpu")), seed=5)
    gen = torch.Generator().manual_seed(0)
    seq, firsts = 12, (5, 2)  # first documents of 5 and 2 tokens (EOD included)
    rows = []
    for n in firsts:
        rows.append(torch.cat([torch.randint(0, EOD, (n - 1,), generator=gen), torch.tensor([EOD])]))
        rows[-1] = torch.cat([rows[-1], torch.randint(0, EOD, (seq - n,), generator=gen)])
    packed = torch.stack(rows)
    labels = torch.randint(0, EOD, packed.shape, generator=gen)
    positions, documents = document_position_ids(packed, EOD), document_ids(packed, EOD)
    second = (documents == 1).float()
    launches = K.LAUNCHES["flash_attention_bwd"]
    loss, grads = _loss_and_grads(model, packed, labels, positions, documents, second)
    assert (K.LAUNCHES["flash_attention_bwd"] > launches) == (impl == "triton")  # the kernel's document masks
    alone_grads: dict[str, torch.Tensor] = {}
    for r, n in enumerate(firsts):
        tail = slice(n, seq)
        alone, g = _loss_and_grads(model, packed[r : r + 1, tail], labels[r : r + 1, tail], None, None, 1.0)
        assert torch.allclose(loss[r : r + 1, tail], alone, rtol=1e-5, atol=1e-6), (r, loss[r, tail], alone)
        alone_grads = {k: alone_grads.get(k, 0) + v for k, v in g.items()}
        head = slice(0, n)
        first, _ = _loss_and_grads(model, packed[r : r + 1, head], labels[r : r + 1, head], None, None, 1.0)
        assert torch.allclose(loss[r : r + 1, head], first, rtol=1e-5, atol=1e-6), r
    assert grads.keys() == alone_grads.keys()
    for n, g in grads.items():
        assert (g - alone_grads[n]).norm() <= 1e-4 * alone_grads[n].norm() + 1e-8, n
    # without the mask the second documents see the first (and with learned positions, the reset matters too)
    for pos, docs in ((positions, None), (None, documents)):
        other, _ = _loss_and_grads(model, packed, labels, pos, docs, second)
        if docs is None or name == "gpt2":  # (RoPE is relative: under the mask, shifted positions cancel)
            assert not torch.allclose(other[:, 5:], loss[:, 5:], rtol=1e-3), (case, pos is None)


def short_documents(directory: str, vocab: int) -> str:
    """An indexed dataset of 200 documents of 2 to 9 tokens, each ending with the EOD id vocab - 1."""
    from megatron_lite.data.indexed import IndexedDatasetWriter

    prefix = os.path.join(directory, "short_text_document")
    if not os.path.exists(prefix + ".idx"):
        w = IndexedDatasetWriter(prefix, vocab_size=vocab)
        gen = torch.Generator().manual_seed(3)
        for _ in range(200):
            n = int(torch.randint(1, 9, (1,), generator=gen))
            w.add_document(torch.cat([torch.randint(0, vocab - 1, (n,), generator=gen), torch.tensor([vocab - 1])]))
        w.finalize()
    return prefix


def test_datasets_built_from_the_flags_carry_documents(tmp_path):
    """The flags reach the samples through the dataset builder (what pretrain runs), and --eod-mask-loss drops
    the loss where the input is EOD, as Megatron does: the first token of the next document, predicted from
    the end of the previous one."""
    from megatron_lite.data.builder import build_datasets, resolve_data
    from megatron_lite.data.config import DataConfig

    vocab = 50
    prefix = short_documents(str(tmp_path), vocab)
    kw = dict(data_path=(prefix,), tokenizer_type="NullTokenizer", vocab_size=vocab - 1, split="1,0,0")
    plain = DataConfig(**kw)
    config = DataConfig(**kw, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    source = resolve_data(config)
    assert source.tokenizer.eod == vocab - 1
    sample = build_datasets(source, config, (4, 0, 0), 16, seed=1)[0][0]
    base = build_datasets(resolve_data(plain), plain, (4, 0, 0), 16, seed=1)[0][0]
    tokens = sample["tokens"]
    assert torch.equal(tokens, base["tokens"]) and (tokens == vocab - 1).any()
    assert torch.equal(sample["document_ids"], document_ids(tokens, vocab - 1)) and "document_ids" not in base
    assert torch.equal(sample["position_ids"], document_position_ids(tokens, vocab - 1))
    assert torch.equal(sample["loss_mask"], (tokens != vocab - 1).float())
    assert torch.equal(base["position_ids"], torch.arange(16)) and bool(base["loss_mask"].all())


LAYOUTS = {  # world, layout, global batch, micro-batch, keywords
    "tp2-sp": (2, P(tensor_model_parallel_size=2, sequence_parallel=True), 4, 2, {}),
    "pp2": (2, P(pipeline_model_parallel_size=2), 4, 1, {}),
    "dp2-zero1": (2, P(), 4, 2, {"distributed_optimizer": True}),
    # context parallelism: every rank holds the whole sequence's document ids (the attention itself, the flash
    # kernel's included: tests/test_context_parallel.py -k document)
    "cp2-ring": (2, P(context_parallel_size=2), 4, 2, {}),
    "cp2-a2a": (2, P(context_parallel_size=2, cp_comm_type="a2a"), 4, 2, {}),
    "cp2-allgather": (2, P(context_parallel_size=2, cp_comm_type="allgather"), 4, 2, {}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_document_masks_under_parallelism_equal_one_process(dist, tmp_path, layout):
    world, parallel, gbs, mbs, kw = LAYOUTS[layout]
    vocab = CONFIGS["llama"]().vocab_size
    data = "documents:" + short_documents(str(tmp_path), vocab)
    ref = train_run("llama", P(), gbs, gbs, data=data)
    plain = train_run("llama", P(), gbs, gbs, data="packed:" + data.split(":", 1)[1])  # the flags change the run
    assert any(abs(a[0] - b[0]) > 1e-3 * b[0] for a, b in zip(ref, plain))
    for history in dist(world, train_run, "llama", parallel, gbs, mbs, data=data, **kw):
        _compare(history, ref)
