"""A hybrid Mamba model's layers (--hybrid-override-pattern; models/mamba.py, models/hybrid_pattern.py) in the
planner's terms, from the model's dimensions alone.

Each layer is one residual block of one kind (models/transformer.py's HybridLayer), which the planner prices as a
heterogeneous layer of one part (planner/params.py, memory.py, cost.py read `layer_block`): `*` attention with a
no-op MLP, `-` and `E` an MLP or MoE with a no-op attention, and `M` a Mamba mixer in the attention's place
(MAMBA_MIXER). A mixer's TP collectives are a normal part's: in_proj column-parallel (under SP its input gathered,
its input gradient reduce-scattered), out_proj row-parallel (its output reduce-scattered, all-reduced without SP);
the mixer between them calls none.

What a mixer saves for its backward (`mixer_activation_bytes`) is read off models/mamba.py as PyTorch runs it,
per token of this rank's sequence, its heads, groups and channels split over TP (d = heads x head_dim, gn =
groups x state, conv = d + 2 gn, H heads, G groups, N state, P head_dim, all this rank's; a the compute dtype's
bytes, the scan in fp32, 4):
  in the compute dtype   in_proj's output z x B C dt (2d + 2gn + H; the conv keeps it through its view of x B C),
                         the conv's output with its D_CONV - 1 padded steps (conv (s + 3) / s), out_proj's input d
  fp32, per token        softplus's input H, the SiLU'd conv (x, B, C; fp32, or its fp32 copy) conv, the gated
                         norm's y, silu(z), product and normalised output 4d, its 1/rms G (and z's fp32 copy d
                         when the model is not fp32)
  fp32, per padded step  the chunked scan (L = min(128, s) steps a chunk, the sequence padded to whole chunks):
                         the decays exp(seg) and C.B, and the einsums' contiguous copies of their operands, 4LH,
                         5HN, 4H and 3d (x three times); of one chunk 4LH, 2HN, 3H and 2d (the state it starts
                         from is zeros, and none is passed on; d alone for a micro-batch of one sequence)
  fp32, per chunk        the state carried into it, twice (but the first's zeros), and its decay: 2 H P N + H
(the input norm and in_proj's input as a transformer layer's; a few constants a layer, A and the causal mask,
left out). Selective recomputation recomputes nothing in a mixer (no --recompute-modules names a part of it); full
recomputation keeps the layer's input alone, as any layer's. Held to the activation meter exactly by
tests/test_planner_hybrid.py.
"""

from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.models.heterogeneous import NO_OP, NORMAL, BlockConfig
from megatron_lite.models.hybrid_pattern import ATTENTION, MAMBA
from megatron_lite.models.mamba import CHUNK_SIZE, D_CONV

MAMBA_MIXER = "mamba"  # (a BlockConfig's attention part: the Mamba mixer of an M layer)
_KINDS = {
    MAMBA: BlockConfig(attention=MAMBA_MIXER, mlp=NO_OP),
    ATTENTION: BlockConfig(attention=NORMAL, mlp=NO_OP),
}
_MLP_ONLY = BlockConfig(attention=NO_OP, mlp=NORMAL)  # - and E
# PyTorch operators a mixer launches per forward (in_proj, conv, SiLU, softplus, the scan's einsums and their
# copies, the gated norm, out_proj...), and per chunk of the scan's state loop; the backward about twice as many
MIXER_OPS, MIXER_OPS_PER_CHUNK = 70, 3


def layer_block(model: ModelConfig, layer: int) -> BlockConfig | None:
    """The parts of decoder layer `layer`: a heterogeneous layer's block, a hybrid layer's one part, None for a
    plain transformer layer (and a multi-token-prediction depth)."""
    if layer >= model.num_layers:
        return None
    if model.heterogeneous_blocks is not None:
        return model.heterogeneous_blocks[layer]
    if model.hybrid:
        return _KINDS.get(model.layer_types[layer], _MLP_ONLY)
    return None


def mixer_dims(model: ModelConfig, tp: int) -> tuple[int, int, int, int]:
    """(d, gn, H, G) of one TP rank's mixer: inner dims, groups x state, heads, groups."""
    d, gn = model.mamba_heads * model.mamba_head_dim, model.mamba_num_groups * model.mamba_state_dim
    return d // tp, gn // tp, model.mamba_heads // tp, model.mamba_num_groups // tp


def mamba_tensors(model: ModelConfig, tp: int) -> list:
    """The parameters of one M layer on one TP rank as planner/params.py lists them (elements, the matrix Muon
    steps or None, expert), in the model's order: its norm, dt_bias, A_log and D a head, in_proj [z x B C dt,
    hidden] (column-parallel), the depthwise conv's [channels, 1, D_CONV] weight (3-D: Adam under Muon) and bias,
    the gated norm's weight, out_proj [hidden, d] (row-parallel)."""
    from megatron_lite.planner.params import Matrix, norm_tensors  # (params.py imports this module)

    h = model.hidden_size
    d, gn, heads, _ = mixer_dims(model, tp)
    conv = d + 2 * gn
    norm = norm_tensors(model, h)
    rows = 2 * d + 2 * gn + heads
    # (the model's order: the mixer's own dt_bias, A_log and D before its submodules' weights)
    out = norm + [(heads, None, False)] * 3 + [(h * rows, Matrix(rows, h, 0), False)]
    out += [(conv * D_CONV, None, False), (conv, None, False)]
    return out + [(d, None, False), (d * h, Matrix(h, d, 1), False)]


def chunking(seq: int) -> tuple[int, int]:
    """(steps a chunk, chunks) of the scan over a sequence of `seq` steps (ssd_scan: one chunk of a shorter one)."""
    steps = min(CHUNK_SIZE, seq)
    return steps, -(-seq // steps)


def mixer_activation_bytes(model: ModelConfig, tp: int, a: int, seq: int, sequences: int) -> float:
    """Bytes one Mamba mixer (in_proj to out_proj) saves per token of a micro-batch of `sequences` sequences of
    `seq` tokens on this rank; `a` bytes per value of the compute dtype (see the module's docstring)."""
    d, gn, heads, groups = mixer_dims(model, tp)
    conv, n, p = d + 2 * gn, model.mamba_state_dim, model.mamba_head_dim
    steps, chunks = chunking(seq)
    total = ((2 * d + 2 * gn + heads) + conv * (seq + D_CONV - 1) / seq + d) * a
    total += (heads + conv + 4 * d + groups + (d if a != 4 else 0)) * 4
    if chunks > 1:
        per_step = 4 * steps * heads + 5 * heads * n + 4 * heads + 3 * d
    else:  # the state carried in is zeros (no gradient): C's copy for it, and what a next chunk would be passed
        per_step = 4 * steps * heads + 2 * heads * n + 3 * heads + 2 * d  # (`added`), are not kept
        per_step -= d if sequences == 1 else 0  # (one sequence of one chunk: its batched GEMM reads x in place)
    total += per_step * 4 * steps * chunks / seq
    # (the last chunk's update of the state is not kept either: no later chunk reads it)
    return total + ((2 * chunks - 1) * heads * p * n + chunks * heads) * 4 / seq


def scan_flops(model: ModelConfig, seq: int) -> float:
    """FLOPs per token of the sequence that models/mamba.py's chunked ssd_scan executes, as a forward's (a third of
    its forward and backward; all the model's heads), not Megatron's 7 d N (training/flops.py's, which MFU keeps):
    per head and padded step, C.B over the chunk 2 L N, the decayed product with x 2 L P, each chunk's added state
    2 P N and the carried state read by C 2 P N (L steps a chunk, P head dim, N state; the sequence padded to whole
    chunks, the padded steps computed too), the backward twice these; but of one chunk the backward runs 2 P N of
    the states' 8 P N (the state carried in is zeros, none is passed on). About 1.4x Megatron's figure at
    Nemotron-H's sizes, 3.4x at N = 16."""
    steps, chunks = chunking(seq)
    p, n = model.mamba_head_dim, model.mamba_state_dim
    per_head = 2 * steps * n + 2 * steps * p + (4 if chunks > 1 else 2) * p * n
    return model.mamba_heads * per_head * steps * chunks / seq


def mixer_ops(seq: int) -> int:
    """Operators a mixer launches in one forward and backward over sequences of `seq` tokens (an estimate)."""
    return 3 * (MIXER_OPS + MIXER_OPS_PER_CHUNK * chunking(seq)[1])
