"""MoE kernels against their references: permutation (with capacity-dropped pairs), the weighted inverse
(gradients for the expert outputs and the routing weights), and the grouped GEMM over uneven expert groups
(empty groups included). CPU: Triton interpreter, fp32."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import kernels as K

from models import DEVICE, rel

TOL = 1e-5


def _routing(t=23, k=2, e=5, h=20, seed=0, drop=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    indices = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    keep = torch.rand(t, k, generator=g) > 0.2 if drop else None
    probs = torch.rand(t, k, generator=g)
    return x.to(DEVICE), indices.to(DEVICE), None if keep is None else keep.to(DEVICE), probs.to(DEVICE)


@pytest.mark.parametrize("drop", [False, True])
def test_permute_then_unpermute(drop):
    x, indices, keep, probs = _routing(drop=drop)
    before = K.LAUNCHES["moe_permute"], K.LAUNCHES["moe_unpermute"]

    def run(permute, unpermute):
        xs, ps = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        permuted, row_map = permute(xs, indices, keep)
        y = unpermute(permuted * 2.0 + 1.0, row_map, ps)  # some "expert" in between
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.device))
        return [permuted.detach(), row_map.float(), y.detach(), xs.grad, ps.grad]

    ours = run(K.moe_permute, K.moe_unpermute)
    ref = run(K.moe_permute_reference, lambda o, m, p: K.moe_unpermute_reference(o, m, p))
    assert K.LAUNCHES["moe_permute"] > before[0] and K.LAUNCHES["moe_unpermute"] > before[1]
    for name, a, b in zip(["permuted", "row_map", "y", "dx", "dprobs"], ours, ref):
        assert rel(a, b) < TOL, name
    sorted_experts = indices.reshape(-1)[(keep.reshape(-1) if drop else slice(None))].sort().values
    assert ours[0].shape[0] == len(sorted_experts)


@pytest.mark.parametrize("counts", [[5, 0, 17, 1], [33], [0, 0, 3]])
def test_grouped_gemm(counts):
    g = torch.Generator().manual_seed(0)
    counts_t = torch.tensor(counts)
    x = torch.randn(int(counts_t.sum()), 24, generator=g).to(DEVICE)
    w = torch.randn(len(counts), 36, 24, generator=g).to(DEVICE)
    before = K.LAUNCHES["grouped_gemm_bwd"]

    def run(fn):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fn(xs, ws, counts_t)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device))
        return [y.detach(), xs.grad, ws.grad]

    ours, ref = run(K.grouped_gemm), run(K.grouped_gemm_reference)
    assert K.LAUNCHES["grouped_gemm_bwd"] > before
    for name, a, b in zip(["y", "dx", "dw"], ours, ref):
        assert rel(a, b) < TOL, name
    # the experts' own weights (as the MoE layer passes them): each gets its gradient, and nothing but the
    # parameters themselves is saved for the backward (no stacked copy)
    xs = x.clone().requires_grad_(True)
    ws = [w[e].clone().requires_grad_(True) for e in range(len(counts))]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = K.grouped_gemm(xs, ws, counts_t)
    assert not [t for t in saved if t.dim() == 3], [tuple(t.shape) for t in saved]
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device))
    assert rel(y.detach(), ref[0]) < TOL and rel(xs.grad, ref[1]) < TOL
    assert rel(torch.stack([t.grad for t in ws]), ref[2]) < TOL


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_dropped_pairs_read_nothing(impl):
    """A dropped pair (row_map -1) contributes exactly nothing: not 0 x a stand-in row, which is NaN when that
    row holds an inf; and a chunk whose every pair was dropped (no expert output rows at all) combines to zeros
    (the overlapped all-to-all's second chunk past the experts' capacity indexed an empty tensor)."""
    unpermute = K.moe_unpermute if impl == "triton" else K.moe_unpermute_reference
    out = torch.randn(3, 8).to(DEVICE)
    out[0] = float("inf")
    row_map = torch.tensor([[1, -1], [2, 0]]).to(DEVICE)  # token 0's second pair dropped
    probs = torch.tensor([[0.6, 0.4], [0.5, 0.5]]).to(DEVICE)
    y = unpermute(out, row_map, probs)
    assert torch.equal(y[0], 0.6 * out[1]) and not torch.isfinite(y[1]).all()  # token 1 does read the inf row
    empty = unpermute(torch.zeros(0, 8, device=DEVICE), torch.full((4, 2), -1, device=DEVICE), probs.repeat(2, 1))
    assert empty.shape == (4, 8) and not empty.any()


def test_grouped_gemm_grids_fit_cuda_at_real_expert_sizes(monkeypatch):
    """(From a kernel review: the interpreter has no grid limit.) With the GPU's tiles, every launch of the
    grouped GEMM fits CUDA's grid (axis 0 < 2^31, the others <= 65535) for one Mixtral-8x22B expert (fc1
    [2 x 16384, 6144]); the weight gradient put 98304 blocks on the second axis, and the launch failed."""
    import megatron_lite.kernels.moe as moe

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(moe, "_grouped_mm", Recorder())
    monkeypatch.setattr(moe, "_grouped_mm_dw", Recorder())
    monkeypatch.setattr(moe, "_cfg", lambda: (64, 64, 32))  # (the GPU's tiles, not the interpreter's)
    experts, rows = 8, 4096
    for n, k in ((2 * 16384, 6144), (6144, 16384)):  # fc1, fc2
        x = torch.empty(rows, k, device="meta")
        w = torch.empty(experts, n, k, device="meta")
        tiles = torch.empty(rows // 64, dtype=torch.int64, device="meta")
        moe._grouped_backward(x, w, torch.empty(rows, n, device="meta"), tiles, tiles, tiles, want_dw=True)
    assert len(grids) == 4
    for grid in grids:
        assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), grid
