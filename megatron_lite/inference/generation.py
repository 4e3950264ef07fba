"""Autoregressive generation under any TP x PP (x EP) layout, with a KV cache (and each Mamba layer's conv window and
SSM state, for hybrid models), one prompt or a batch; not under CP or SP.

Each step runs the new tokens (the whole prompt first, the shortest of a batch's, then one token) through the
virtual pipeline stages in order, hidden states passed stage to stage by point-to-point sends; the last stage
gathers the vocabulary shards, picks the next token (greedy, or temperature / top-k / top-p sampling from a seeded
generator) and broadcasts it over the pipeline group, so every rank extends the same sequence. Log-probabilities
are those of the model's own distribution (before temperature and top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.inference.kv_cache import KVCache, cache_bytes
from megatron_lite.models.attention import SelfAttention
from megatron_lite.models.gpt_model import stream_dtype
from megatron_lite.models.mla import MultiLatentAttention
from megatron_lite.optimizer.optimizer import any_rank
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.mappings import all_gather_last


@dataclass
class SamplingConfig:
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: no top-k filter (applied before top-p, as transformers does)

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:  # (NaN included)
            raise ValueError(f"--temperature {self.temperature} must be > 0 (or use --greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k} must be >= 0 (0: no top-k filter)")


def _forward(chunks, ctx: ParallelContext, ids: list[int], cache: KVCache, every: bool = False) -> torch.Tensor | None:
    """One sequence's new tokens: `_forward_batch`'s logits of its one row, [n, V] or [1, V]."""
    out = _forward_batch(chunks, ctx, torch.tensor([ids], device=ctx.device), cache, every)
    return None if out is None else out[0]


def _forward_batch(chunks, ctx: ParallelContext, tokens: torch.Tensor, cache: KVCache, every: bool = False):
    """The new tokens [batch, n] (every sequence at the same positions) through every virtual stage; the last
    stage returns full-vocabulary logits [batch, n, V] (`every`), else those of the last position [batch, 1, V]."""
    pp, vp = ctx.pp.size, len(chunks)
    b, n = tokens.shape
    positions = torch.arange(cache.offset, cache.offset + n, device=ctx.device).unsqueeze(0).expand(b, n)
    config = chunks[0].config
    dtype = chunks[0].params_dtype  # (the build dtype: a stage may hold no parameter)
    dtype = stream_dtype(config, dtype)  # (what a stage sends: fp32 under --fp32-residual-connection)
    hidden = None
    out = None
    for stage in range(pp * vp):
        rank, chunk = stage % pp, stage // pp
        if rank != ctx.pp.rank:
            continue
        if stage > 0 and pp > 1:
            hidden = torch.empty(n, b, config.hidden_size, dtype=dtype, device=ctx.device)
            dist.recv(hidden, ctx.pp.ranks[(stage - 1) % pp], group=ctx.pp.pg)
        y = chunks[chunk](tokens, positions, hidden_states=hidden, kv_cache=cache, last_logits_only=not every)
        if stage == pp * vp - 1:
            logits = y  # [batch, n, padded vocab / TP]
            if ctx.tp.size > 1:
                logits = all_gather_last(logits.contiguous(), ctx.tp)
            out = logits[..., : config.vocab_size].float()
        elif pp > 1:
            dist.send(y.contiguous(), ctx.pp.ranks[(stage + 1) % pp], group=ctx.pp.pg)
        else:
            hidden = y
    cache.advance(n)
    return out


def generation_bytes(chunks, ctx: ParallelContext, batch: int, max_len: int, scored_rows: int) -> int:
    """What a generation holds on this rank beside the model: the KV cache, multi-latent attention's absorbed
    up-projections where they are not views of a weight (NF4, LoRA), and on the last stage the scored prompts'
    fp32 logits, `scored_rows` positions of each sequence (gathered over TP, then the fp32 copy)."""
    config, dtype = chunks[0].config, chunks[0].params_dtype
    # (the decoder's layers: generation never runs the multi-token-prediction depths; a hybrid model's attention
    # layers hold keys and values, its Mamba layers a state, its MLP layers nothing)
    # Each attention layer by its own config (a heterogeneous model's layers have their own query groups; a no-op
    # or linear one caches nothing), a Llama 4 chunked one at a chunk's tokens.
    need = 0
    for m in (m for c in chunks for m in c.decoder.modules()):
        if isinstance(m, (SelfAttention, MultiLatentAttention)):
            chunked = int(getattr(m, "core_attention", None) is not None and m.core_attention.chunk is not None)
            layer = config.layer_config(m.layer_number)
            need += cache_bytes(layer, ctx.tp.size, 1, batch, max_len, dtype, chunked_layers=chunked)
    mamba = sum(getattr(layer, "kind", None) == "M" for c in chunks for layer in c.decoder.layers)
    need += cache_bytes(config, ctx.tp.size, 0, batch, max_len, dtype, mamba_layers=mamba)
    need += sum(m.absorbed_bytes() for c in chunks for m in c.decoder.modules() if isinstance(m, MultiLatentAttention))
    if ctx.is_last_stage:
        need += 2 * batch * scored_rows * config.vocab_size * 4
    return need


def _check_memory_fits(chunks, ctx: ParallelContext, batch: int, max_len: int, scored_rows: int) -> None:
    """A generation (`generation_bytes`) larger than the free memory of any rank (the GPU's; on a CPU the
    host's available memory) is one line naming what sizes it, on every rank (it was an out-of-memory error in
    the middle of the prompt's forward, and the other ranks waited for it; on a CPU an allocator traceback)."""
    free = _free_bytes(ctx.device)  # (None where unknown: still every rank's vote, so none waits)
    need = generation_bytes(chunks, ctx, batch, max_len, scored_rows)
    short = free is not None and need > 0.9 * free  # (the forward's activations need some too)
    if any_rank(short, ctx):
        where = f"{need / 2**30:.2f} GiB on this rank, {free / 2**30:.2f} GiB are free" if short else "on another rank"
        raise ValueError(
            f"the KV cache of {batch} prompt(s) x {max_len} tokens (the longest prompt + --max-new-tokens) and the "
            f"scored prompts' logits do not fit: {where}; lower --inference-max-requests or --max-new-tokens, or "
            "spread the model over more ranks (--tensor/--pipeline-model-parallel-size)"
        )


def _free_bytes(device: torch.device) -> int | None:
    """The memory a generation may take: the GPU's free memory, or the host's MemAvailable (Linux); None where
    unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], rows: int = 1024) -> list[float]:
    """Each prompt token's log-probability after the first, a block of rows at a time (a [prompt, vocab] fp32
    log-softmax at once was 2 GB for a 4096-token prompt at a 64000 vocabulary)."""
    targets = torch.tensor(prompt[1:], device=logits.device, dtype=torch.long)
    out = []
    for a in range(0, len(prompt) - 1, rows):
        block = logits[a : min(a + rows, len(prompt) - 1)]
        picked = block.gather(1, targets[a : a + block.shape[0]].unsqueeze(1)).squeeze(1)
        out += (picked - torch.logsumexp(block, dim=-1)).tolist()
    return out


def _choose(logits: torch.Tensor, s: SamplingConfig, gen: torch.Generator) -> int:
    if s.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_distribution(logits, s), 1, generator=gen))


def sampling_distribution(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """What a token is drawn from: softmax(logits / temperature), cut to the top k, then to the smallest prefix
    reaching top_p, renormalised (float64, on the CPU)."""
    scaled = logits.double().cpu() / s.temperature
    if 0 < s.top_k < scaled.numel():  # the k most likely (and any tied with the k-th), as transformers keeps
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, s.top_k).values[-1], -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    if s.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < s.top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs / probs.sum()


@torch.no_grad()
def generate(
    chunks,
    ctx: ParallelContext,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: tuple[int, ...] = (),
    prompt_logprobs: bool = True,
    top_n_logprobs: int = 0,
) -> dict:
    """Returns generated_ids on every rank; logprobs and prompt_logprobs on the last pipeline stage (those of the
    prompt only when `prompt_logprobs`: they take the whole prompt's logits). `max_new_tokens` 0 scores the prompt
    (Megatron's tokens_to_generate=0): its log-probabilities, nothing generated."""
    return generate_batch(chunks, ctx, [prompt], max_new_tokens, sampling, stop_ids, prompt_logprobs, top_n_logprobs)[0]


@torch.no_grad()
def generate_batch(
    chunks,
    ctx: ParallelContext,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: tuple[int, ...] = (),
    prompt_logprobs: bool = True,
    top_n_logprobs: int = 0,
) -> list[dict]:
    """`generate` for several prompts at once, one result each, as each alone would give (up to rounding: each
    draws from its own generator, seeded alike). As Megatron's static batching does, every sequence sits at the
    same positions, so no padding or mask is needed: the shortest prompt is run whole, then one position a step,
    where a longer prompt's next token is its own, not a generated one (a Mamba layer's state thus runs over each
    sequence's own tokens, one a step past the shortest prompt); a sequence done (a stop id, or its
    `max_new_tokens`) rides along until all are. Under an MoE capacity factor the tokens of one forward compete
    for the experts' capacity, so a batch's drops differ from each prompt's alone (tools/generate.py runs such a
    model one prompt at a time). `top_n_logprobs` N: at each generated token, the N most likely tokens and their
    log-probabilities (Megatron's top_n_logprobs), on the last stage."""
    sampling = sampling or SamplingConfig()
    # Context parallelism would take the prompt and the cache for each rank's zigzag shard of a sequence, and
    # sequence parallelism splits the tokens of one step: generation runs neither (refused, not wrong logits).
    if ctx.cp.size > 1 or ctx.sequence_parallel:
        what = f"--context-parallel-size {ctx.cp.size}" if ctx.cp.size > 1 else "--sequence-parallel"
        raise ValueError(f"generation does not run under {what}: build the model for it without (TP x PP x EP only)")
    if not prompts or not all(prompts):
        raise ValueError("generation needs a non-empty prompt for each sequence")
    for c in chunks:
        c.eval()
    longest, shortest, b = max(map(len, prompts)), min(map(len, prompts)), len(prompts)
    max_pos = chunks[0].config.max_position_embeddings
    fed = longest + max(max_new_tokens - 1, 0)  # (the last token generated is never fed back)
    if fed > max_pos and chunks[0].config.position_embedding_type == "learned_absolute":
        raise ValueError(f"prompt + --max-new-tokens - 1 = {fed} positions fed exceed the {max_pos} learned ones")
    gens = [torch.Generator().manual_seed(sampling.seed) for _ in prompts]
    scoring = max_new_tokens == 0 or prompt_logprobs
    _check_memory_fits(chunks, ctx, b, longest + max_new_tokens, shortest if scoring else 1)
    cache = KVCache(longest + max_new_tokens)
    generated: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    scored: list[list[float]] = [[] for _ in prompts]
    top: list[list[dict[str, float]]] = [[] for _ in prompts]
    done = [max_new_tokens == 0 and len(p) == shortest for p in prompts]  # (scored whole by the first forward)
    head = torch.tensor([p[:shortest] for p in prompts], device=ctx.device)
    # (every stage alike: the last one's logits decide nothing)
    logits = _forward_batch(chunks, ctx, head, cache, every=scoring)
    last = logits is not None
    if scoring and last:
        scored = [_prompt_logprobs(logits[i], p[:shortest]) for i, p in enumerate(prompts)]
    position = shortest  # the position whose token is chosen next
    while not all(done):
        # each sequence's next token: its prompt's, or one chosen from its logits on the last stage and sent to
        # every rank (the last stage's to every stage, then TP rank 0's and DP rank 0's to their groups, so no
        # replica can pick, or stop on, a token of its own)
        choice = torch.zeros(b, 2, dtype=torch.float64, device=ctx.device)
        for i, p in enumerate(prompts):
            if last and position >= len(p) and not done[i]:
                row = logits[i, -1]
                token = _choose(row, sampling, gens[i])
                choice[i, 0], choice[i, 1] = token, float(row[token] - torch.logsumexp(row, dim=-1))
                if top_n_logprobs:  # (ids as strings: JSON's keys; ties in the model's order, as torch.topk's)
                    values, ids = torch.topk(torch.log_softmax(row, dim=-1), min(top_n_logprobs, row.numel()))
                    top[i].append({str(int(t)): float(v) for v, t in zip(values, ids)})
        choosing = any(position >= len(p) and not done[i] for i, p in enumerate(prompts))  # (alike on every rank)
        for group, src in ((ctx.pp, ctx.pp.ranks[-1]), (ctx.tp, ctx.tp.ranks[0]), (ctx.dp, ctx.dp.ranks[0])):
            if group.size > 1 and choosing:
                dist.broadcast(choice, src, group=group.pg)
        tokens = []
        for i, p in enumerate(prompts):
            if position < len(p):  # still in its prompt
                token = p[position]
                if scoring and last:
                    row = logits[i, -1]
                    scored[i].append(float(row[token] - torch.logsumexp(row, dim=-1)))
            elif not done[i]:
                token = int(choice[i, 0])
                generated[i].append(token)
                logprobs[i].append(float(choice[i, 1]))
                done[i] = token in stop_ids or len(generated[i]) == max_new_tokens
            else:
                token = 0  # (a finished sequence's: its logits are not read)
            tokens.append(token)
            done[i] = done[i] or (max_new_tokens == 0 and position + 1 == len(p))
        if all(done):
            break
        logits = _forward_batch(chunks, ctx, torch.tensor([tokens], device=ctx.device).t(), cache)
        position += 1
    out = [{"generated_ids": g} for g in generated]
    if ctx.is_last_stage:
        for i, o in enumerate(out):
            o.update(logprobs=logprobs[i], prompt_logprobs=scored[i] if scoring else None)
            if top_n_logprobs:
                o["top_n_logprobs"] = top[i]
    return out
