"""Megatron-Core's MoE upcycling (megatron/core/transformer/moe/upcycling_utils.py; Komatsuzaki et al., and
https://arxiv.org/abs/2410.07524 for the granularity): an MoE model's weights made from a dense model's.

Every weight the two share is copied. Each MoE layer's experts come from the dense layer's MLP: with granularity G
the dense hidden units are cut into G chunks (a gated unit's gate and up halves each cut alike, so chunk j pairs
gate_j with up_j), expert e holds chunk e mod G, and the router's rows are made equal within each group of G
consecutive experts (row e is this model's own initial row e // G), so a token routed to a group uses all of its
G chunks with equal weights. The experts' weights are scaled so the routed sum stays the dense output's size:
the activation scale is G (top-k then softmax: a whole group's weights sum to 1) or E G / k (--moe-router-pre-softmax:
each weight is about 1/E), spread over the layer's matrices as its cube root (a gated unit, or squared ReLU: the
output is cubic in the scale) or its square root. fc2's bias is each expert's whole, unscaled.

What this preserves (tests/test_upcycling.py): with G = 1 and routing weights that sum to 1 over the chosen experts
(top-k then softmax, Megatron's default) each token's MLP output is exactly the dense one (every expert is the
dense MLP, the weights sum to 1). With G > 1 too, when the activation is positively homogeneous (ReLU, squared ReLU:
act(s x) = s^p act(x)) and the top-k takes whole groups (k a multiple of G); with SiLU, GELU or SwiGLU it is close,
not equal (act(s x) != s act(x)). With --moe-router-pre-softmax, only on average (the weights are about 1/E).

Loading is layout-free as every checkpoint load here: each rank computes the full upcycled tensors it holds a
piece of, from the dense checkpoint's full tensors, and keeps its pieces (any TP, EP, PP of the MoE run).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megatron_lite.config import ConfigError, ModelConfig

_EXPERT = re.compile(r"^(?P<mlp>.*\.mlp\.)experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)$")
_ROUTER = re.compile(r"^.*\.mlp\.router\.(weight|bias)$")


def weight_scale(config: ModelConfig, granularity: int) -> float:
    """The factor each expert matrix (and fc1's bias) is multiplied by: Megatron's _get_weight_scale."""
    if config.moe_router_pre_softmax:
        activation_scale = config.num_experts * granularity / config.moe_router_topk
    else:
        activation_scale = granularity
    cubic = config.gated_linear_unit or config.activation == "squared_relu"
    return activation_scale ** (1 / 3 if cubic else 1 / 2)


def _chunk_rows(fc1: torch.Tensor, granularity: int, j: int, gated: bool) -> torch.Tensor:
    """Chunk j of G of fc1's rows (its weight or bias): of the gate and the up halves each, for a gated unit."""
    if not gated:
        return torch.tensor_split(fc1, granularity, dim=0)[j]
    gate, up = torch.chunk(fc1, 2, dim=0)
    return torch.cat([torch.tensor_split(gate, granularity, dim=0)[j], torch.tensor_split(up, granularity, dim=0)[j]])


def upcycled_tensor(
    name: str,
    dense: Callable[[str], torch.Tensor | None],
    own: Callable[[], torch.Tensor],
    config: ModelConfig,
    granularity: int,
) -> torch.Tensor | None:
    """The full MoE tensor `name` (a global name) from the dense model's full tensors (`dense(name)`, None where the
    dense model has none), or None to keep this model's own initialisation. `own()`: this model's full tensor."""
    m = _EXPERT.match(name)
    if m is not None:
        src = dense(f"{m['mlp']}{m['fc']}.{m['kind']}")
        if src is None:
            raise ConfigError(f"the dense checkpoint has no {m['mlp']}{m['fc']}.{m['kind']} to upcycle {name} from")
        src, j = src.float(), int(m["e"]) % granularity
        if m["fc"] == "linear_fc2" and m["kind"] == "bias":
            return src.clone()  # (every expert adds it whole: a group's weights sum to 1)
        src = src * weight_scale(config, granularity)
        if m["fc"] == "linear_fc2":
            return torch.tensor_split(src, granularity, dim=1)[j].clone()
        return _chunk_rows(src, granularity, j, config.gated_linear_unit).clone()
    if _ROUTER.match(name):
        # (Megatron's _process_router_param: the first E/G rows of the model's own, each repeated G times in turn)
        init = own()
        return init[: init.shape[0] // granularity].repeat_interleave(granularity, dim=0)
    return dense(name)


def upcycle_state_dict(
    dense_state: dict[str, torch.Tensor], moe_state: dict[str, torch.Tensor], config: ModelConfig, granularity: int
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Megatron's upcycle_state_dict on full tensors: (the MoE state, the names that kept `moe_state`'s values
    because the dense model has no such weight, shared experts say)."""
    out, kept = {}, []
    for name, t in moe_state.items():
        up = upcycled_tensor(name, dense_state.get, lambda t=t: t, config, granularity)
        if up is None:
            kept.append(name)
            up = t
        elif tuple(up.shape) != tuple(t.shape):
            raise ConfigError(f"upcycling: {name} is {list(up.shape)} from the dense model but {list(t.shape)} here")
        out[name] = up.to(t.dtype)
    return out, kept


def load_upcycled(path: str, model, ctx, granularity: int) -> list[str]:
    """Fill `model` (an MoE model, any layout) with the weights upcycled from the dense checkpoint at `path`: each
    rank reads the full dense tensors its pieces come from. No collective (every rank reads the same files).
    Returns the global names that kept their initialisation (no dense counterpart)."""
    from megatron_lite.checkpoint.checkpointing import read_metadata
    from megatron_lite.checkpoint.format import full_shape, local_pieces
    from megatron_lite.checkpoint.reader import Reader
    from megatron_lite.parameters import named_param_meta

    reader = Reader(path, read_metadata(path))

    def dense(name: str) -> torch.Tensor | None:
        key = f"main/{name}" if f"main/{name}" in reader.index else f"model/{name}"  # (a bf16 run's fp32 weights)
        return reader.read_full(key) if key in reader.index else None

    kept = []
    for name, p, meta in named_param_meta(model):
        gname = model.global_name(name)
        pieces = local_pieces(tuple(p.shape), meta)

        def own(p=p, pieces=pieces, gname=gname) -> torch.Tensor:
            """This model's full tensor (the router's: replicated, each rank's tensor is the full one; FSDP2's
            shards are gathered, every rank asking for the same weights in the same order)."""
            local = p.full_tensor() if hasattr(p, "full_tensor") else p
            if len(pieces) != 1 or pieces[0].length != local.shape[pieces[0].dim]:
                raise ConfigError(f"upcycling: {gname} is sharded here; the router is expected whole on every rank")
            return local.detach().float().cpu()

        full = upcycled_tensor(gname, dense, own, model_config(model), granularity)
        if full is None:
            kept.append(gname)
            continue
        if list(full.shape) != (mine := full_shape(tuple(p.shape), meta)):
            raise ConfigError(f"{path}: {gname} would be {list(full.shape)} upcycled but this model's is {mine}")
        target = torch.zeros(p.shape, dtype=p.dtype, device=ctx.device) if hasattr(p, "device_mesh") else p
        with torch.no_grad():
            target.zero_()  # (vocabulary padding is not stored: it stays zero)
            for pc in pieces:
                target.narrow(pc.dim, pc.local_start, pc.length).copy_(full.narrow(pc.dim, pc.full_start, pc.length))
            if hasattr(p, "device_mesh"):  # FSDP2: this rank's shard of the full tensor
                from megatron_lite.distributed.fsdp import local_shard

                p.copy_(local_shard(target, p))
    return kept


def model_config(model) -> ModelConfig:
    return getattr(model, "config", None) or next(iter(model)).config
