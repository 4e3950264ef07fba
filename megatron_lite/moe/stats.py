"""Per-step MoE bookkeeping outside the model: the weight of the auxiliary losses, the aux-loss-free
expert-bias update, and the routing metrics (tokens per expert, imbalance, dropped pairs, losses).

Token counts are summed over every replica of the stage (TP x CP x DP) and divided by TP, whose ranks
route the same tokens; so every replica updates its expert bias identically, and the counts are those
of the whole global batch, as on one process. Layers on other pipeline stages are summed in over PP, so
the logging rank reports every layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.models.transformer import HybridLayer, TransformerLayer
from megatron_lite.moe.layer import MoELayer
from megatron_lite.parallel_context import ParallelContext


def moe_layers(model: nn.Module) -> dict[int, MoELayer]:
    """Global layer number -> MoE layer, for the layers this rank holds."""
    return {
        m.layer_number: m.mlp
        for m in model.modules()
        if isinstance(m, (TransformerLayer, HybridLayer)) and isinstance(getattr(m, "mlp", None), MoELayer)
    }


def prepare_step(layers: dict[int, MoELayer], num_microbatches: int, loss_scale: float, ctx: ParallelContext) -> None:
    """Each micro-batch's auxiliary loss weighs 1 / (all micro-batches of the global batch); a CP rank's loss is
    its share of its micro-batch's (the router's), so the shares of the CP ranks add up."""
    for layer in layers.values():
        layer.aux_loss_scale = loss_scale / (num_microbatches * ctx.dp.size)
        layer.reset_stats()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
    counts = counts.to(bias.device, torch.float32)
    bias += rate * torch.sign(counts.mean() - counts)  # (FSDP2 leaves it whole: every rank updates it alike)


def finish_step(layers: dict[int, MoELayer], config, num_microbatches: int, ctx: ParallelContext) -> dict:
    """Reduce the statistics of the step, update the expert biases, and return the metrics."""
    n_layers, e = config.num_layers + config.mtp_num_layers, config.num_experts  # (MTP layers numbered after)
    # Per layer: [routed counts (E), kept counts (E), aux loss, z loss, routed pairs, dropped pairs]
    table = torch.zeros(n_layers, 2 * e + 4, dtype=torch.float64, device=ctx.device)
    for number, layer in layers.items():
        if layer.stats_row is not None:
            table[number] = layer.stats_row
    if ctx.tp_cp_dp.size > 1:
        with ctx.tp_cp_dp.blocked():
            dist.all_reduce(table, group=ctx.tp_cp_dp.pg)
    table /= ctx.tp.size  # TP ranks route the same tokens
    for number, layer in layers.items():
        # the bias trains with the router: a frozen router (LoRA fine-tuning) keeps its bias too
        if layer.router.expert_bias is not None and layer.router.weight.requires_grad:
            # by the tokens each expert processed, after capacity dropping (Megatron's local_tokens_per_expert)
            update_expert_bias(layer.router.expert_bias, table[number, e : 2 * e], config.moe_router_bias_update_rate)
    if ctx.pp.size > 1:
        with ctx.pp.blocked():
            dist.all_reduce(table, group=ctx.pp.pg)
    table = table.cpu()
    micro = num_microbatches * ctx.dp.size  # (CP ranks hold shares of the same micro-batches' losses)
    aux_coeff, z_coeff = config.moe_aux_loss_coeff or 1.0, config.moe_z_loss_coeff or 1.0
    per_layer = {}
    for number in range(n_layers):
        if not config.is_moe_layer(number):
            continue
        counts = table[number, :e]
        per_layer[number] = {
            "tokens_per_expert": [int(c) for c in counts.tolist()],
            "imbalance": float(counts.max() / counts.mean()) if counts.sum() > 0 else 0.0,
            # (Megatron's --moe-per-layer-logging: each layer's losses, before their coefficients)
            "aux_loss": float(table[number, 2 * e]) / micro / aux_coeff,
            "z_loss": float(table[number, 2 * e + 1]) / micro / z_coeff,
        }
    moe = [n for n in range(n_layers) if config.is_moe_layer(n)]
    routed, dropped = table[moe, 2 * e + 2].sum(), table[moe, 2 * e + 3].sum()
    # logged as Megatron logs them: the mean over MoE layers, before the coefficient (--moe-aux-loss-coeff 1e-2
    # on a balanced router logs about 1, not 1e-2 x layers)
    per = micro * max(len(moe), 1)
    return {
        "aux_loss": float(table[moe, 2 * e].sum()) / per / aux_coeff,
        "z_loss": float(table[moe, 2 * e + 1].sum()) / per / z_coeff,
        "dropped_fraction": float(dropped / routed) if routed > 0 else 0.0,
        "max_imbalance": max((v["imbalance"] for v in per_layer.values()), default=0.0),
        "layers": per_layer,
    }


def log_losses(moe: dict | None, config) -> dict[str, float]:
    """A step's balancing and z losses under the names Megatron tracks: the load-balancing loss of the type in use
    (none for --moe-router-load-balancing-type none, nor with --moe-aux-loss-coeff 0: an aux-loss-free run), the z
    loss only with --moe-z-loss-coeff."""
    if moe is None:
        return {}
    kind = config.moe_router_load_balancing_type
    on = kind in ("aux_loss", "seq_aux_loss") and config.moe_aux_loss_coeff
    out = {f"moe_{kind}": moe["aux_loss"]} if on else {}
    return {**out, **({"moe_z_loss": moe["z_loss"]} if config.moe_z_loss_coeff is not None else {})}


def step_layer_losses(moe: dict | None, config) -> dict[str, float]:
    """--moe-per-layer-logging: each MoE layer's tracked losses of this step (log_losses' kinds), for W&B and
    TensorBoard, where Megatron writes them every iteration as moe/<its name>_layer_<layer index>."""
    if moe is None:
        return {}
    kinds = [k.removeprefix("moe_") for k in log_losses(moe, config)]
    return {
        f"moe_layer{layer}_{k}": st["z_loss" if k == "z_loss" else "aux_loss"]
        for layer, st in moe["layers"].items()
        for k in kinds
    }


def log_metrics(moe: dict | None, config=None, per_layer_losses: bool = False) -> dict:
    """The last step's routing metrics: scalars for the console and W&B, per-layer detail for JSONL (the losses
    are logged as their means over the log window: log_losses). `per_layer_losses` (--moe-per-layer-logging):
    each layer's losses too, the last step's, those log_losses tracks (scalars, and moe_layer_losses in JSONL)."""
    if moe is None:
        return {}
    out = {f"moe_{k}": moe[k] for k in ("dropped_fraction", "max_imbalance")}
    tracked = log_losses(moe, config) if config is not None else {"moe_aux_loss": 0, "moe_z_loss": 0}
    kinds = [k.removeprefix("moe_").replace("seq_aux_loss", "aux_loss") for k in tracked]
    for layer, st in moe["layers"].items():
        out[f"moe_layer{layer}_imbalance"] = st["imbalance"]
        if per_layer_losses:
            out.update({f"moe_layer{layer}_{k}": st[k] for k in kinds})
    out["moe_tokens_per_expert"] = {str(layer): st["tokens_per_expert"] for layer, st in moe["layers"].items()}
    if per_layer_losses:
        out["moe_layer_losses"] = {str(layer): {k: st[k] for k in kinds} for layer, st in moe["layers"].items()}
    return out
