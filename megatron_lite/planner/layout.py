"""One candidate way to run a job: the parallel sizes, how weights and optimizer state are sharded across
data-parallel ranks, recomputation, and the batch geometry."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig

SHARDINGS = ("none", "dist-opt", "zero2", "fsdp2")  # DDP, ZeRO-1, ZeRO-2, ZeRO-3 through FSDP2
# (and "layer-wise": --optimizer dist_muon's whole tensors a data-parallel rank, in place of DDP's "none")
RECOMPUTES = ("none", "selective", "full")  # what we run; "op" (torchtitan's per-op policy) is priced only


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sharding: str = "none"
    recompute: str = "none"
    micro_batch_size: int = 1
    # with full recomputation: --recompute-method and --recompute-num-layers (a script's; the search's are uniform 1,
    # and block with the fewest layers that fit: search.fewest_block_layers)
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # a script's --overlap-grad-reduce / --overlap-param-gather where they differ from the search's (None: on
    # wherever the sharding takes them, as the search plans every layout)
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    sequence_parallel: bool = True  # with TP > 1 (Megatron's recommendation; off only when asked)
    cp_comm_type: str = "p2p"  # with CP > 1: the ring, a2a (heads all-to-all) or allgather (keys and values)
    microbatch_group_size: int | None = None  # a script's --microbatch-group-size-per-virtual-pipeline-stage
    # the layers of each virtual stage when not an even split (a script's uneven first/last stages or layout)
    stages: tuple[int, ...] | None = None
    # --expert-tensor-parallel-size where it differs from TP (None: the experts split as the dense layers)
    etp: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def overlaps_grad_reduce(self) -> bool:
        """--overlap-grad-reduce: the script's, else the search's (FSDP2 overlaps its own without the flag, which
        has no effect there)."""
        return (
            self.overlap_grad_reduce if self.overlap_grad_reduce is not None else searched_grad_overlap(self.sharding)
        )

    @property
    def overlaps_param_gather(self) -> bool:
        """--overlap-param-gather: the script's, else the search's."""
        if self.overlap_param_gather is not None:
            return self.overlap_param_gather
        return searched_gather_overlap(self.sharding)

    @property
    def recompute_as_searched(self) -> bool:
        """Full recomputation as uniform 1 (the search's block N, where it finds one, shows its N)."""
        return self.recompute != "full" or (self.recompute_method, self.recompute_num_layers) == ("uniform", 1)

    def params_key(self) -> Layout:
        """This layout reduced to what decides each rank's parameters (the parallel sizes that split the weights):
        the key of the planner's caches of them, which a search's layouts share."""
        return Layout(self.tp, self.pp, self.vp, ep=self.ep, stages=self.stages, etp=self.etp)

    def activations_key(self) -> Layout:
        """This layout without what leaves each rank's activations as they are: the sharding (but FSDP2's, under
        which no fp8 weights are cached) and the overlaps. The key of the planner's cache of them, which a search's
        shardings share."""
        sharding = "fsdp2" if self.sharding == "fsdp2" else "none"
        return dataclasses.replace(self, sharding=sharding, overlap_grad_reduce=None, overlap_param_gather=None)

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size."""
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """The experts' data-parallel size: the ranks of a pipeline stage over expert TP x EP (Megatron's expert
        grid; at expert TP = TP, DP x CP over EP)."""
        return max(self.tp * self.dp * self.cp // (self.expert_tp * self.ep), 1)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vp if self.vp > 1 else None,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=self.sp,
            cp_comm_type=self.cp_comm_type,
            microbatch_group_size=self.microbatch_group_size,
            pipeline_layout=self.stages,
        )

    def training_config(self, global_batch_size: int, seq_length: int) -> TrainingConfig:
        return TrainingConfig(
            micro_batch_size=self.micro_batch_size, global_batch_size=global_batch_size, seq_length=seq_length
        )

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """The model as this layout runs it: Megatron's recomputation flags."""
        return _with_recompute(model, self.recompute, self.recompute_method, self.recompute_num_layers)

    def micro_batches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.dp)

    def describe(self) -> str:
        parts = [f"TP{self.tp}" + ("+SP" if self.sp else ""), f"PP{self.pp}"]
        if self.stages is not None:
            parts[-1] += "(" + "/".join(str(n) for n in self.stages) + ")"
        if self.vp > 1:
            parts.append(f"VP{self.vp}" + (f"(G{self.microbatch_group_size})" if self.microbatch_group_size else ""))
        parts += [f"DP{self.dp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}" + ("" if self.cp_comm_type == "p2p" else f"({self.cp_comm_type})"))
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.expert_tp != self.tp:
            parts.append(f"ETP{self.expert_tp}")
        names = {"none": "ddp", "dist-opt": "zero1", "zero2": "zero2", "fsdp2": "fsdp2", "layer-wise": "layer-wise"}
        parts.append(names[self.sharding])
        # (a script's choices the search does not make)
        off = [
            x for x, v in (("reduce", self.overlap_grad_reduce), ("gather", self.overlap_param_gather)) if v is False
        ]
        parts[-1] += f"(no overlap: {', '.join(off)})" if off else ""
        parts.append(f"recompute={self.recompute}")
        if not self.recompute_as_searched:
            parts[-1] += f"({self.recompute_method} {self.recompute_num_layers})"
        parts.append(f"mbs={self.micro_batch_size}")
        return " ".join(parts)


def searched_grad_overlap(sharding: str) -> bool:
    """The search overlaps the gradient reduction wherever the sharding takes --overlap-grad-reduce."""
    return sharding != "fsdp2"


def searched_gather_overlap(sharding: str) -> bool:
    """... and the updated weights' gather wherever it takes --overlap-param-gather."""
    return sharding in ("dist-opt", "zero2")


@functools.lru_cache(maxsize=256)
def _with_recompute(model: ModelConfig, recompute: str, method: str, layers: int) -> ModelConfig:
    # Cached (the configs are frozen): a search asks for the same three per model hundreds of thousands of
    # times, and each replace re-validates the whole config. `method` and `layers`: full recomputation's only.
    if recompute == "none":
        return dataclasses.replace(model, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    if recompute == "selective":
        return dataclasses.replace(
            model, recompute_granularity="selective", recompute_method=None, recompute_num_layers=None
        )
    return dataclasses.replace(
        model, recompute_granularity="full", recompute_method=method, recompute_num_layers=layers
    )
