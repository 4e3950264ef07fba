"""The Mamba-2 mixer of hybrid models (Nemotron-H; Megatron-Core's ssm/mamba_mixer.py), in plain PyTorch.

in_proj makes, per token, z (the gate), x, B, C and dt (Megatron's zxBCdt layout); a causal depthwise conv1d and
SiLU run over x, B and C; dt = softplus(dt + dt_bias); the SSD scan with A = -exp(A_log) runs per head

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D x_t

(B and C shared by the heads of a group); then the gated RMSNorm norm(y * silu(z)) over each group's dims, and
out_proj. The scan is chunked (`ssd_scan`): within a chunk the outputs are a masked, decayed attention-like
product, and one state per head is carried from chunk to chunk. There is no Triton SSD kernel here: the scan runs
in fp32 PyTorch, which is slow at Nemotron-H's sizes but exact.

Tensor parallelism follows Megatron: in_proj is column-parallel with z, x, B, C and dt each split over the ranks
(whole heads and whole groups on each), the conv1d, dt_bias, A_log, D and the gated norm's weight are split the same
way, and out_proj is row-parallel; the mixer itself calls no collective. Under --tp-comm-overlap (with sequence
parallelism) in_proj's all-gather and out_proj's reduce-scatter run as the overlapped rings, as the MLP's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import ParamMeta, set_param_meta
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.tensor_parallel.sharding import ShardSpec

# Megatron's MambaMixer constants (its constructor's defaults, which MambaLayer does not override)
D_CONV = 4
CHUNK_SIZE = 128
A_INIT_RANGE = (1.0, 16.0)
DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4
GATED_NORM_EPS = 1e-5  # (Megatron's ExtendedRMSNorm is built with eps=1e-5, whatever --norm-epsilon says)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    initial_state: torch.Tensor | None = None,
    final_state: bool = False,
):
    """The selective scan y_t = C_t . S_t with S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, from S_0 = 0 (or
    `initial_state` [b, heads, p, n], a generation's state after the tokens before these).

    x [b, s, heads, p], dt [b, s, heads] (after softplus), A [heads] (negative), B and C [b, s, groups, n]; returns
    y [b, s, heads, p] (no D term), and with `final_state` also S after the last step [b, heads, p, n] (what a
    generation keeps). Chunks of `chunk_size` steps: inside one, y_t sums the chunk's earlier inputs
    weighted by (C_t . B_u) exp(sum of dt A over (u, t]); the state entering the chunk adds C_t . S exp(sum over the
    chunk up to t). Every exponent is a sum of dt A <= 0, taken only over u <= t, so nothing overflows."""
    b, s, h, p = x.shape
    rep = h // B.shape[2]
    B = B.repeat_interleave(rep, dim=2)  # [b, s, heads, n]: each head reads its group's B and C
    C = C.repeat_interleave(rep, dim=2)
    chunk_size = min(chunk_size, s)  # (a sequence shorter than a chunk: one chunk of its length, not padded out)
    pad = (-s) % chunk_size
    if pad:  # (zero dt at the end: no input and no decay, and those outputs are dropped)
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    k, L = (s + pad) // chunk_size, chunk_size
    x, B, C = (t.reshape(b, k, L, h, -1) for t in (x, B, C))
    dt = dt.reshape(b, k, L, h)
    a = (dt * A).cumsum(dim=2)  # [b, k, L, h]: the log decay from the chunk's start through step t
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = (a.unsqueeze(3) - a.unsqueeze(2)).masked_fill(~causal[None, None, :, :, None], float("-inf"))
    weights = torch.einsum("bcthn,bcuhn->bctuh", C, B) * seg.exp()  # [b, k, t, u, h]
    y = torch.einsum("bctuh,bcuh,bcuhp->bcthp", weights, dt, x)
    # What each chunk adds to the state it passes on: its inputs decayed to its end.
    to_end = (a[:, :, -1:] - a).exp() * dt  # [b, k, L, h]
    added = torch.einsum("bcuh,bcuhn,bcuhp->bchpn", to_end, B, x)
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.to(x.dtype)
    carried = []
    for c in range(k):
        carried.append(state)
        state = state * a[:, c, -1].exp()[:, :, None, None] + added[:, c]
    carried = torch.stack(carried, dim=1)  # [b, k, h, p, n]: the state entering each chunk
    y = y + torch.einsum("bcthn,bchpn->bcthp", C, carried) * a.exp().unsqueeze(-1)
    y = y.reshape(b, k * L, h, p)[:, :s]
    return (y, state) if final_state else y  # (the padded steps neither decay nor add: `state` is S_s)


def ssm_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence (a decoding step, Megatron's `_ssm_decode`): S' = exp(dt A) S + dt x B^T and
    y = S' C, from state S [b, heads, p, n], x [b, heads, p], dt [b, heads] (after softplus), B and C [b, groups, n];
    returns y [b, heads, p] (no D term) and S'."""
    rep = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)  # each head its group's
    state = state * torch.exp(dt * A)[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, C), state


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """Megatron's RMSNormGated with norm_before_gate=False: RMS-normalise y * silu(z) over each group's dims, in
    fp32, then times the weight; the result in y's dtype."""
    f = torch.promote_types(y.dtype, torch.float32)
    g = y.to(f) * F.silu(z.to(f))
    g = g.unflatten(-1, (groups, -1))
    g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)
    return (g.flatten(-2) * weight.to(f)).to(y.dtype)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], meta: ParamMeta, device, dtype) -> None:
    setattr(module, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
    set_param_meta(module, name, meta)


class MambaMixer(nn.Module):
    """Megatron's MambaMixer (its parameter names: in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32) -> None:
        super().__init__()
        tp = ctx.tp
        self.heads, self.head_dim = config.mamba_heads // tp.size, config.mamba_head_dim
        self.groups, self.state_dim = config.mamba_num_groups // tp.size, config.mamba_state_dim
        d_inner, gn = config.mamba_heads * config.mamba_head_dim, config.mamba_num_groups * config.mamba_state_dim
        self.d_inner, self.gn = d_inner // tp.size, gn // tp.size  # (this rank's)
        self.conv_dim = self.d_inner + 2 * self.gn
        self.chunk_size = CHUNK_SIZE
        # (Megatron's mixer: no biases on the projections whatever --disable-bias-linear says)
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            [d_inner, d_inner, gn, gn, config.mamba_heads],  # z, x, B, C, dt: each split over the ranks
            tp,
            bias=False,
            sequence_parallel=ctx.sequence_parallel,
            # (Megatron's tp_comm_buffer_name "fc1": overlapped under --tp-comm-overlap as the MLP's fc1 is; the
            # ring's GEMM keeps the local [z_r; x_r; B_r; C_r; dt_r] rows, so the split below reads the same)
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_ag,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.init_method_std,
            device=device,
            dtype=dtype,
        )
        # the depthwise conv over x, B, C: PyTorch's Conv1d init, U(+-1 / sqrt(kernel size)) for weight and bias
        self.conv1d = nn.Module()
        conv = ShardSpec.even(0, (d_inner, gn, gn), tp.size)
        bound = D_CONV**-0.5
        conv_meta = ParamMeta(("uniform", bound), conv, tp.rank)
        _param(self.conv1d, "weight", (self.conv_dim, 1, D_CONV), conv_meta, device, dtype)
        _param(self.conv1d, "bias", (self.conv_dim,), conv_meta, device, dtype)
        per_head = ShardSpec.even(0, config.mamba_heads, tp.size)
        dt_init = ("mamba_dt_bias", DT_MIN, DT_MAX, DT_INIT_FLOOR)
        _param(self, "dt_bias", (self.heads,), ParamMeta(dt_init, per_head, tp.rank), device, dtype)
        a_meta = ParamMeta(("mamba_A_log", *A_INIT_RANGE), per_head, tp.rank)
        _param(self, "A_log", (self.heads,), a_meta, device, dtype)
        _param(self, "D", (self.heads,), ParamMeta(("ones",), per_head, tp.rank), device, dtype)
        self.norm = nn.Module()  # the gated RMSNorm's weight, over this rank's groups
        norm = ShardSpec.even(0, d_inner, tp.size)
        _param(self.norm, "weight", (self.d_inner,), ParamMeta(("ones",), norm, tp.rank), device, dtype)
        self.out_proj = RowParallelLinear(
            d_inner,
            config.hidden_size,
            tp,
            bias=False,
            sequence_parallel=ctx.sequence_parallel,
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_rs,  # (Megatron's "fc2")
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.output_layer_init_std,
            device=device,
            dtype=dtype,
        )

    def forward(self, hidden: torch.Tensor, kv_cache=None, layer: int | None = None) -> torch.Tensor:
        """hidden [seq (shard), batch, hidden] -> the same shape. With `kv_cache` (generation): these tokens continue
        each sequence from the conv window and SSM state the cache holds for `layer` (from zeros where it holds none:
        the prompt), and leave there the window and state after them; one token is one step of the recurrence."""
        zxbcdt = self.in_proj(hidden)  # [seq, batch, this rank's z x B C dt]
        s, b, _ = zxbcdt.shape
        z, xbc, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.heads], dim=-1)
        xbc = xbc.permute(1, 2, 0)  # [batch, channels, seq]: causal, so padded on the left only
        held = None if kv_cache is None else kv_cache.mamba_state(layer)
        if kv_cache is None:
            xbc = F.conv1d(xbc, self.conv1d.weight, self.conv1d.bias, padding=D_CONV - 1, groups=self.conv_dim)
            xbc = xbc[..., :s]
        else:  # the window of the D_CONV - 1 inputs before these (zeros before the prompt), then these
            window = xbc.new_zeros(b, self.conv_dim, D_CONV - 1) if held is None else held[0]
            xbc = torch.cat([window, xbc], dim=-1)
            window = xbc[..., -(D_CONV - 1) :]
            xbc = F.conv1d(xbc, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        xbc = F.silu(xbc).transpose(1, 2)  # [batch, seq, channels]
        f = torch.promote_types(hidden.dtype, torch.float32)  # (the scan in fp32 at least)
        x, B, C = xbc.to(f).split([self.d_inner, self.gn, self.gn], dim=-1)
        x = x.unflatten(-1, (self.heads, self.head_dim))
        B, C = (t.unflatten(-1, (self.groups, self.state_dim)) for t in (B, C))
        dt = F.softplus(dt.to(f) + self.dt_bias.to(f)).transpose(0, 1)  # [batch, seq, heads]
        A = -torch.exp(self.A_log.to(f))
        if kv_cache is None:
            y = ssd_scan(x, dt, A, B, C, self.chunk_size)
        elif held is not None and s == 1:  # a decoding step
            y, state = ssm_step(held[1], x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
            y = y.unsqueeze(1)
        else:  # the prompt (or several tokens on the cache): the chunked scan, from the state held if any
            initial = None if held is None else held[1]
            y, state = ssd_scan(x, dt, A, B, C, self.chunk_size, initial_state=initial, final_state=True)
        if kv_cache is not None:
            kv_cache.keep_mamba_state(layer, window, state)
        y = y + x * self.D.to(f)[:, None]
        y = y.flatten(-2).transpose(0, 1)  # [seq, batch, this rank's d_inner]
        y = gated_rms_norm(y, z, self.norm.weight, self.groups, GATED_NORM_EPS).to(hidden.dtype)
        return self.out_proj(y)
