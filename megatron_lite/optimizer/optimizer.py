"""AdamW on fp32 main weights, with global grad-norm clipping and fp16 loss scaling.

Model weights may be bf16/fp16; the optimizer then keeps fp32 main copies, steps them with fp32 gradients
(the data-parallel wrapper accumulates main gradients in fp32, or in bf16 with --grad-reduce-in-bf16, copied
up for the step) and copies them back. With fp32 model
weights the main weights are the model weights.

The global grad norm counts every parameter exactly once: tensor-parallel shards on every TP rank,
replicated parameters on TP rank 0 only, summed over the model-parallel group (TP x PP). After the
data-parallel reduction all DP ranks hold the same gradients, so no DP reduction is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import ConfigError
from megatron_lite.optimizer.adam import DTYPES, PrecisionAwareAdamW
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_lite.optimizer.muon import MuonParam, MuonWithAdam, qkv_split_rows
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import hold_copy, named_param_meta

GradOf = Callable[[nn.Parameter], torch.Tensor]


@dataclass
class StepResult:
    updated: bool  # False when fp16 gradients overflowed and the step was skipped
    grad_norm: float | None  # before clipping; None on a skipped step
    loss_scale: float


def state_kinds(config: OptimizerConfig) -> tuple[str, ...]:
    """The per-parameter state the optimizer keeps and checkpoints carry: Adam's two moments, SGD's momentum
    buffer (nothing without momentum)."""
    if config.optimizer == "sgd":
        return ("momentum_buffer",) if config.sgd_momentum > 0 else ()
    if config.is_muon:  # Adam's moments for what Adam steps, Muon's momentum for its matrices
        return ("exp_avg", "exp_avg_sq", "momentum_buffer")
    return ("exp_avg", "exp_avg_sq")


def state_bytes_per_param(config: OptimizerConfig) -> int:
    """Bytes of optimizer state per parameter: Adam's two moments in their dtypes (8 in fp32, 4 in bf16), SGD's
    momentum buffer (4, none without momentum)."""
    if config.optimizer == "sgd":
        return 4 * len(state_kinds(config))
    if config.is_muon:  # an upper bound: Adam's 8 (Muon's matrices keep 4; muon_state_bytes knows which)
        return 8
    return sum(DTYPES[getattr(config, k)].itemsize for k in ("exp_avg_dtype", "exp_avg_sq_dtype"))


def muon_state_bytes(params) -> float:
    """Bytes of optimizer state per parameter, on average, of `params` ((group name, ndim, numel) each) under
    --optimizer muon: Muon's momentum (4 bytes) on the matrices it steps, Adam's two moments (8) on the rest."""
    total = muon = 0
    for name, ndim, numel in params:
        total += numel
        muon += numel if runs_muon(name, ndim) else 0
    return (8 * total - 4 * muon) / total if total else 8.0


def state_entry(d: dict[str, torch.Tensor], config: OptimizerConfig, step: int, part=lambda t: t) -> dict | None:
    """One parameter's optimizer state from saved tensors `d` (each passed through `part`: a shard's slice), for
    `load_inner_state`; None when the checkpoint has none for it."""
    kinds = state_kinds(config)
    if config.is_muon:  # each parameter has Muon's momentum or Adam's moments
        kinds = ("momentum_buffer",) if "momentum_buffer" in d else ("exp_avg", "exp_avg_sq")
    if not kinds or kinds[0] not in d:
        return None
    entry = {k: part(d[k]) for k in kinds}
    if "exp_avg" in entry:
        entry["step"] = torch.tensor(float(step))
    return entry


def _inner_optimizer(groups, config: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (Megatron's adam: decoupled weight decay), or with --optimizer sgd torch's SGD with
    --sgd-momentum (weight decay added to the gradient), as Megatron builds them."""
    if not groups:  # a rank that trains nothing (a pipeline stage holding only frozen LoRA base weights, or
        # a distributed-optimizer rank owning no part) still steps with every other rank
        groups = [{"params": [], "weight_decay": 0.0}]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    kw = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    dtypes = {k: DTYPES[getattr(config, k)] for k in ("exp_avg_dtype", "exp_avg_sq_dtype")}
    if any(d != torch.float32 for d in dtypes.values()):  # (fp32 moments: torch's own, fused on CUDA)
        return PrecisionAwareAdamW(groups, **kw, **dtypes)
    if config.use_apex_adam:
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex, optional
        except ImportError as e:
            raise ConfigError("--use-apex-adam needs NVIDIA apex installed (github.com/NVIDIA/apex)") from e
        return FusedAdam(groups, adam_w_mode=True, **kw)
    if device.type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


def muon_optimizer(model: nn.Module, entries, metas, config: OptimizerConfig, ctx: ParallelContext) -> MuonWithAdam:
    """Megatron's get_megatron_muon_optimizer: Muon for the 2-D weights but the word embeddings and output layer
    (each told its tensor-parallel split and group: the expert TP group for experts, and the fused QKV's parts),
    AdamW with the Adam flags for the rest; both with the same weight-decay and learning-rate groups."""
    qkv = {  # the fused QKV weights, by name, and their parts' rows per query group
        f"{prefix}.linear_qkv.weight" if prefix else "linear_qkv.weight": qkv_split_rows(
            m.heads_per_group, m.head_dim, m.gated
        )
        for prefix, m in model.named_modules()
        if hasattr(m, "linear_qkv") and hasattr(m, "heads_per_group")
    }
    muon, adam, info = [], [], {}
    for (main, name, ndim), meta in zip(entries, metas):
        if not runs_muon(name, ndim):
            adam.append((main, name, ndim))
            continue
        muon.append((main, name, ndim))
        dim = meta.shard.dim if meta.tensor_parallel else None
        split = qkv.get(name) if config.muon_split_qkv else None
        info[id(main)] = MuonParam(name, dim, ctx.etp if meta.expert else ctx.tp, split)
    groups = [{**g, "muon": True} for g in optimizer_groups(muon, config)] + optimizer_groups(adam, config)
    return MuonWithAdam(
        groups or [{"params": [], "weight_decay": 0.0}],
        lambda adam_groups: _inner_optimizer(adam_groups, config, ctx.device),
        info,
        momentum=config.muon_momentum,
        nesterov=config.muon_use_nesterov,
        num_ns_steps=config.muon_num_ns_steps,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        fp32_matmul_prec=config.muon_fp32_matmul_prec,
        tp_mode=config.muon_tp_mode,
    )


def is_embedding_or_output(name: str) -> bool:
    """The parameters --decoupled-lr applies to (Megatron's is_embedding_or_output_parameter): the word
    embeddings and the output layer, by their names in any chunk or wrapper."""
    return name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))


def runs_muon(name: str, ndim: int) -> bool:
    """Megatron's rule for --optimizer muon: every 2-D parameter but the word embeddings and the output layer
    (`name` as group_name gives it: a stage's copy of the embeddings is named as them)."""
    return ndim == 2 and not is_embedding_or_output(name)


def takes_weight_decay(name: str, ndim: int, config: OptimizerConfig) -> bool:
    """Megatron's rule: no weight decay on one-dimensional parameters (norms) and biases; with
    --apply-wd-to-qk-layernorm, the --qk-layernorm weights (and biases) decay as the matrices do."""
    if config.apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
        return True
    if config.skip_embedding_weight_decay and "embedding" in name:  # (Megatron's rule: by name)
        return False
    return not (ndim == 1 or name.endswith(".bias"))


def group_name(name: str, meta) -> str:
    """The name a parameter is grouped by: a pipeline stage's copy of the tied word embeddings (the last
    stage's output layer) as the embeddings themselves, so both copies take the same weight decay."""
    return "embedding.word_embeddings.weight" if meta.embedding_copy else name


def optimizer_groups(entries, config: OptimizerConfig) -> list[dict]:
    """The optimizer's parameter groups for (tensor, parameter name, parameter ndim) entries: weight decay as
    `takes_weight_decay` says; with --decoupled-lr, the embeddings and output layer in groups of their own."""
    groups: dict[tuple[bool, bool], list] = {}
    for tensor, name, ndim in entries:
        decoupled = is_embedding_or_output(name) and config.decoupled_lr is not None
        groups.setdefault((takes_weight_decay(name, ndim, config), decoupled), []).append(tensor)
    return [
        {
            "params": params,
            "weight_decay": config.weight_decay if decay else 0.0,
            "decay": decay,
            "decoupled": decoupled,
        }
        for (decay, decoupled), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
    ]


def set_lr(
    inner: torch.optim.Optimizer, lr: float, decoupled_lr: float | None, weight_decay: float | None = None
) -> None:
    """This step's rates; `weight_decay` (--weight-decay-incr-style linear|cosine) goes to the decaying groups."""
    for group in inner.param_groups:
        group["lr"] = decoupled_lr if group.get("decoupled") and decoupled_lr is not None else lr
        if weight_decay is not None and group.get("decay"):
            group["weight_decay"] = weight_decay


def fp32(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients the fp32 main weights step with: bf16 main gradients (--grad-reduce-in-bf16) are copied
    up, as Megatron does; fp32 ones are used in place."""
    return [g if g.dtype == torch.float32 else g.float() for g in grads]


FP64_CHUNK = 1 << 24  # values a norm casts to fp64 at a time (a bounded temporary, whatever the tensor's size)


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """In fp64: an fp32 norm of a large tensor was 1e-4 off (a 4096-row embedding gradient on CPU), so a layout
    that sharded it logged another grad_norm than one process (the shards' smaller norms erred less)."""
    parts = t.reshape(-1).split(FP64_CHUNK)
    return torch.stack([torch.linalg.vector_norm(p, dtype=torch.float64) ** 2 for p in parts]).sum()


@torch.no_grad()  # (also given parameters, for --log-params-norm: no graph is built through them)
def squared_norm(grads: list[torch.Tensor], device, *groups) -> float:
    """Sum of the squares of `grads` (accumulated in fp64), then summed over each group in turn."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    parts = [_sum_of_squares(g) for g in grads if g.numel()]
    if parts:
        sq += torch.stack(parts).sum()
    for group in groups:
        if group.size > 1:
            with group.blocked():
                dist.all_reduce(sq, group=group.pg)
    return float(sq)


def count_zeros(tensors: list[torch.Tensor], device, *groups, minus: int = 0) -> float:
    """Zero entries of `tensors` (less `minus`), then summed over each group in turn (--log-num-zeros-in-grad)."""
    n = torch.full((), -float(minus), dtype=torch.float64, device=device)
    for t in tensors:
        n += t.numel() - torch.count_nonzero(t)
    for group in groups:
        if group.size > 1:
            with group.blocked():
                dist.all_reduce(n, group=group.pg)
    return float(n)


def padding_in(meta, shape: tuple[int, ...], lo: int = 0, hi: int | None = None) -> int:
    """Elements of the flat range [lo, hi) of a tensor-parallel shard of `shape` that are padding (a vocabulary
    padded so TP divides it): their gradients are always zero, and --log-num-zeros-in-grad leaves them out, or
    the count grew with the TP size (Megatron trains its padding rows, so they are no zeros there either)."""
    spec = meta.shard
    if spec is None or spec.sizes == spec.padded_sizes:
        return 0
    rows = (~spec.padding_mask(meta.shard_rank)).nonzero().flatten()
    inner = math.prod(shape[spec.dim + 1 :])
    outer = math.prod(shape[: spec.dim])
    n = shape[spec.dim]
    starts = ((torch.arange(outer)[:, None] * n + rows[None, :]) * inner).flatten()
    hi = math.prod(shape) if hi is None else hi
    return int(((starts + inner).clamp(max=hi) - starts.clamp(min=lo)).clamp(min=0).sum())


def count_real_zeros(pairs: list[tuple[torch.Tensor, int]], device, *groups) -> float:
    """count_zeros of (gradient, its padding elements) pairs, the padding left out."""
    return count_zeros([t for t, _ in pairs], device, *groups, minus=sum(pad for _, pad in pairs))


def any_rank(flag: bool | torch.Tensor, ctx: ParallelContext) -> bool:
    """True if any rank has the flag (a bool, or a one-element device tensor, reduced in place and read once):
    an overflow in any shard skips the step everywhere."""
    t = flag if isinstance(flag, torch.Tensor) else torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    if dist.is_initialized() and ctx.world_size > 1:
        with ctx.tp.blocked():  # the context's timer (any of its groups)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() > 0


def make_scaler(config: OptimizerConfig):
    """Megatron's: a constant --loss-scale under fp16, bf16 or the distributed optimizer (its steps with inf/nan
    gradients skipped), else under fp16 the dynamic scaler, else none."""
    if config.loss_scale and (config.fp16 or config.bf16 or config.use_distributed_optimizer):
        return ConstantGradScaler(config.loss_scale)
    if not config.fp16:
        return None
    return DynamicGradScaler(
        config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window, config.hysteresis
    )


def state_dtype(config: OptimizerConfig, kind: str) -> torch.dtype:
    """The dtype the optimizer keeps state `kind` in (Adam's moments: --exp-avg-dtype / --exp-avg-sq-dtype)."""
    return DTYPES[getattr(config, f"{kind}_dtype")] if kind in ("exp_avg", "exp_avg_sq") else torch.float32


def load_inner_state(inner: torch.optim.Optimizer, states: dict) -> None:
    """Install optimizer state (main tensor -> {step, exp_avg, exp_avg_sq} or {momentum_buffer}) through
    load_state_dict; low-precision moments directly in their dtype (load_state_dict would first make fp32 copies of
    them all, the memory they exist to save)."""
    if isinstance(inner, PrecisionAwareAdamW):
        for main, entry in states.items():
            inner.state[main] = {
                k: v if k == "step" else v.to(device=main.device, dtype=inner.dtypes[k]) for k, v in entry.items()
            }
        return
    sd = inner.state_dict()
    index_of = {}
    for group_sd, group in zip(sd["param_groups"], inner.param_groups):
        for idx, p in zip(group_sd["params"], group["params"]):
            index_of[id(p)] = idx
    sd["state"] = {index_of[id(main)]: entry for main, entry in states.items()}
    inner.load_state_dict(sd)
    if type(inner).__name__ == "FusedAdam":
        # apex keeps one step per parameter group ("assume same step across group") and reads no per-parameter
        # step: without this its bias correction would start again at step 1 over warm moments
        steps = [float(e["step"]) for e in states.values() if "step" in e]
        for group in inner.param_groups if steps else ():
            group["step"] = int(steps[0])
        for st in inner.state.values():  # (a per-parameter step apex never advances would go stale)
            st.pop("step", None)


class OptimizerBase:
    """What the three optimizers (this one, the distributed optimizer, FSDP2's) share: the count of steps
    taken, which checkpoints save as `adam_step` and every rank keeps alike (a rank holding no parameter has
    no per-parameter step to read it from), and starting over."""

    config: OptimizerConfig
    ctx: ParallelContext
    inner: torch.optim.Optimizer
    scaler: object
    steps_taken: int = 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def sync_main_from_model(self) -> None:
        raise NotImplementedError

    # Checkpoint interface. A rank keeps fp32 main weights and state for flat ranges [lo, hi) of parameters (whole
    # parameters, or the distributed optimizer's parts of them); none of these calls a collective, so a checkpoint
    # is written and read with no gather (Megatron's fully parallel save and load).
    sharded = False  # True: no other data-parallel rank keeps this rank's ranges, so it writes them itself

    def state_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, lo, hi) for each flat range of a parameter this rank keeps main weights and state for."""
        raise NotImplementedError

    def state_values(self) -> list[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        """(parameter, lo, kind -> the flat values of that range): 'main' (fp32 main weights where they are not the
        model's own) and the optimizer's state kinds (Adam's moments, momentum) once it has stepped."""
        raise NotImplementedError

    def load_state_values(self, values: dict[tuple[int, int], dict[str, torch.Tensor]], step: int) -> None:
        """The inverse of `state_values`, keyed by (id(parameter), lo): a range without saved main weights takes
        the model's, one without state starts as a new run's."""
        raise NotImplementedError

    def _loaded(self, states: dict, step: int) -> None:
        """After load_state_values: the checkpoint's step count where it held state for what this optimizer trains
        (on any rank: one may train nothing), else a new run's 0 (LoRA's new adapters on a base model's
        checkpoint: its count was taken, and a resume's bias correction jumped ahead of the moments)."""
        self.steps_taken = step if any_rank(bool(states), self.ctx) else 0

    def _prepare_grads(
        self, grads: list[torch.Tensor], norm_of: Callable[[], float]
    ) -> tuple[float, StepResult | None]:
        """The step's fp32 gradients made ready in place: unscaled (fp16, or a constant --loss-scale), their norm
        taken (`norm_of`), then clipped. Or the result of a step every rank skips: an overflow under loss scaling
        (any rank's), a non-finite norm under --check-for-nan-in-loss-and-grad (every rank computed the same); an
        overflow under a constant --loss-scale is that norm too while the check is on (--nan-policy acts)."""
        if self.scaler is not None:
            found = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
            if grads:
                # One fused pass per tensor and one host read for them all: a read per gradient (isfinite().all()
                # per tensor) made a GPU finish each before the next was queued. The same bits as a multiply.
                inv = torch.full((1,), 1.0 / self.scaler.scale, dtype=torch.float32, device=self.ctx.device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            if any_rank(found, self.ctx):
                self.scaler.update(True)
                if self.config.check_for_nan_in_loss_and_grad and isinstance(self.scaler, ConstantGradScaler):
                    # (a constant scale never adapts: Megatron keeps its NaN check on there, and its gradient
                    # check stops the job; the skip alone trained nothing and exited 0 without a word)
                    return math.nan, StepResult(False, math.nan, self.scaler.scale)
                return math.nan, StepResult(False, None, self.scaler.scale)
        norm = norm_of()
        if self.config.check_for_nan_in_loss_and_grad and not math.isfinite(norm):
            return norm, StepResult(False, norm, self.loss_scale)
        if self.config.clip_grad > 0:
            coeff = self.config.clip_grad / (norm + 1e-6)
            if coeff < 1.0 and grads:
                torch._foreach_mul_(grads, coeff)
        return norm, None

    def scale_rows(self, p: nn.Parameter, row_scale: torch.Tensor) -> None:
        """Multiply each dim-0 row of model parameter `p` (this rank's TP shard, whole) by `row_scale` [rows], in the
        model and in this optimizer's main copy of it (QK-clip after a step; every data-parallel rank passes the same
        factors). No collective."""
        raise NotImplementedError

    def reset_state(self) -> None:
        """Main weights from the model; optimizer state and loss scale as a new run's."""
        self.sync_main_from_model()
        self.inner.state.clear()
        for group in self.inner.param_groups:
            if "step" in group:  # (apex's FusedAdam counts its steps per group)
                group["step"] = 0
        self.steps_taken = 0
        if self.scaler is not None:
            self.scaler.load_state_dict(make_scaler(self.config).state_dict())


class MixedPrecisionOptimizer(OptimizerBase):
    def __init__(self, model: nn.Module, grad_of: GradOf, config: OptimizerConfig, ctx: ParallelContext) -> None:
        self.config = config
        self.ctx = ctx
        self.grad_of = grad_of
        self.names, self.params, self.main_params, counted, expert = [], [], [], [], []
        entries, metas = [], []
        for name, p, meta in self._stepped(model):
            main = p if p.dtype == torch.float32 else p.detach().float().clone()
            self.names.append(name)
            self.params.append(p)
            self.main_params.append(main)
            counted.append(hold_copy(meta, ctx))  # (experts: on expert-TP rank 0)
            expert.append(meta.expert)
            entries.append((main, group_name(name, meta), p.ndim))
            metas.append(meta)
        self.main_of = {id(p): main for p, main in zip(self.params, self.main_params)}  # by id(model param)
        self._counted = counted
        self._expert = expert
        self._metas = metas
        # Decided from the config, not from this rank's parameters: a pipeline stage without MoE layers
        # must still join the expert group's reduction.
        self._moe = any(getattr(getattr(m, "config", None), "num_experts", None) for m in model.modules())
        if config.is_muon:
            self.inner = muon_optimizer(model, entries, metas, config, ctx)
        else:
            self.inner = _inner_optimizer(optimizer_groups(entries, config), config, ctx.device)
        self.scaler = make_scaler(config)

    def _stepped(self, model: nn.Module) -> list:
        """(name, parameter, meta) of the parameters this rank keeps state for and steps: every trained one."""
        return [(name, p, meta) for name, p, meta in named_param_meta(model) if p.requires_grad]

    def _sum_groups(self, expert: bool) -> tuple:
        """The groups a per-parameter sum (grad norm, params norm, zeros) is summed over: each parameter is then
        counted exactly once."""
        return (self.ctx.emp,) if expert else (self.ctx.mp,)

    # Checkpoint interface: whole parameters --------------------------------------------------------------
    def state_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        return [(p, 0, p.numel()) for p in self.params]

    def state_values(self) -> list[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        kinds = state_kinds(self.config)
        out = []
        for p, main in zip(self.params, self.main_params):
            d = {} if main is p else {"main": main.reshape(-1)}
            d.update({k: v.reshape(-1) for k, v in self.inner.state.get(main, {}).items() if k in kinds})
            out.append((p, 0, d))
        return out

    @torch.no_grad()
    def load_state_values(self, values: dict[tuple[int, int], dict[str, torch.Tensor]], step: int) -> None:
        states = {}
        for p, main in zip(self.params, self.main_params):
            d = {k: v.view(p.shape) for k, v in values.get((id(p), 0), {}).items()}
            if main is not p:
                main.copy_(d.get("main", p))
            if (entry := state_entry(d, self.config, step)) is not None:
                states[main] = entry
        load_inner_state(self.inner, states)
        self._loaded(states, step)

    def state_bytes(self) -> int:
        """Bytes of optimizer state: separate fp32 main weights and Adam moments (SGD momentum)."""
        total = sum(m.numel() * m.element_size() for p, m in zip(self.params, self.main_params) if m is not p)
        kinds = state_kinds(self.config)
        for st in self.inner.state.values():
            total += sum(v.numel() * v.element_size() for k, v in st.items() if k in kinds)
        return total

    @torch.no_grad()
    def sync_main_from_model(self) -> None:
        for p, main in zip(self.params, self.main_params):
            if main is not p:
                main.copy_(p)

    @torch.no_grad()
    def scale_rows(self, p: nn.Parameter, row_scale: torch.Tensor) -> None:
        # As Megatron's clip_qk: the main weights (where this rank keeps them) and, apart, the model's, scaled in
        # fp32 and rounded once. Every rank scales its model copy alike: dist_muon's owner of `p` casting its
        # scaled main weights instead gave bf16(main * f) there and bf16(bf16(main) * f) on the other ranks, so
        # data-parallel replicas differed. (The next step's cast of the main weights replaces the model's.)
        main = self.main_of.get(id(p))
        factor = row_scale.float().view(-1, *[1] * (p.dim() - 1))
        if main is not None and main is not p:
            main.mul_(factor)
        p.copy_(p.float() * factor)

    def _counted_sum(self, tensors: list[torch.Tensor], fn) -> float:
        """fn over tensors aligned with the parameters: dense shards summed over the model-parallel group
        (TP x PP), experts over the expert-model-parallel group (expert-TP x EP x PP): each parameter counted
        exactly once."""
        total = 0.0
        for want_expert in (False, True):
            if want_expert and not self._moe:
                continue
            mine = [g for g, c, e in zip(tensors, self._counted, self._expert) if c and e == want_expert]
            total += fn(mine, self.ctx.device, *self._sum_groups(want_expert))
        return total

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        return self._counted_sum(grads, squared_norm) ** 0.5

    def params_norm(self) -> float:
        """--log-params-norm: the fp32 main weights' L2 norm, each parameter counted once."""
        return self._counted_sum(self.main_params, squared_norm) ** 0.5

    def grad_zeros(self) -> int:
        """--log-num-zeros-in-grad: zero entries of the (reduced) gradients, each parameter counted once."""
        pairs = [(self.grad_of(p), padding_in(m, tuple(p.shape))) for p, m in zip(self.params, self._metas)]
        return int(self._counted_sum(pairs, count_real_zeros))

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None, weight_decay: float | None = None) -> StepResult:
        # bf16 main gradients (--grad-reduce-in-bf16) are copied to fp32 before they are unscaled, as Megatron
        # copies then unscales: unscaling in bf16 rounded each once more (0.4% at a --loss-scale of 1000)
        grads = fp32([self.grad_of(p) for p in self.params])
        norm, skipped = self._prepare_grads(grads, lambda: self.grad_norm(grads))
        if skipped is not None:
            return skipped
        for main, g in zip(self.main_params, grads):
            main.grad = g
        set_lr(self.inner, lr, decoupled_lr, weight_decay)
        self.inner.step()
        self.steps_taken += 1
        for p, main in zip(self.params, self.main_params):
            main.grad = None  # (a view of the DP buffer, or its fp32 copy): never let autograd accumulate into it
            if main is not p:
                p.copy_(main)
        if self.scaler is not None:
            self.scaler.update(False)
        return StepResult(True, norm, self.loss_scale)
