"""Hugging Face checkpoint directories <-> megatron_lite checkpoints, exactly.

Hugging Face -> ours: config.json gives the model configuration (every field that changes the math is
honoured or refused, see models/hf.py), the safetensors files give the weights, mapped to our full,
unpadded names and written as a one-piece-per-tensor checkpoint at iteration 0: any layout loads it.
The tokenizer files travel along in <save>/hf/, and the checkpoint's data settings name them.

Ours -> Hugging Face: the full tensors are read from whatever layout wrote the checkpoint, mapped back
to the Hub's names (Mixtral experts as w1/w3/w2, no lm_head when tied) and written as safetensors with a
config.json that transformers' from_pretrained loads. Only safetensors are read: a pickled
pytorch_model.bin is refused, because loading it could run code.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file

from megatron_lite.checkpoint.atomic import atomic_write, atomic_write_json, replace_dir
from megatron_lite.checkpoint.checkpointing import (
    find_checkpoint,
    model_config_from_dict,
    publish,
    read_metadata,
)
from megatron_lite.checkpoint.format import FORMAT, complete_iterations, file_digest, iteration_dir
from megatron_lite.checkpoint.hf_checks import (
    EXPORT_CAUSE,
    check_hf_shapes,
    check_not_quantised,
    check_state_dict,
    mapping_errors,
    normalize_hf_names,
)
from megatron_lite.checkpoint.hf_defaults import HF_DEFAULTS, MODEL_TYPES_CLASSES  # noqa: F401 - re-exported
from megatron_lite.checkpoint.hf_defaults import fallback_config as _fallback_config
from megatron_lite.checkpoint.hf_files import (  # noqa: F401 - re-exported
    SIDE_FILES,
    TOKENIZER_FILES,
    check_hf_model_dir,
    check_save_dir,
    copy_side_files,
    read_hf_tensors,
    read_json_object,
    shards,
    tiktoken_side_files,
    write_hf_dir,
)
from megatron_lite.checkpoint.lora_base import lora_base_checkpoint
from megatron_lite.checkpoint.origin import (
    HF_DIR,
    ORIGIN,
    checkpoint_origin,
    has_hf_config,
    hf_side,
    read_hf_config,
)
from megatron_lite.checkpoint.reader import Reader
from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.data.config import DataConfig
from megatron_lite.data.embedded import build_embedded_corpus, trained_on_embedded_corpus
from megatron_lite.data.tokenizers import tokenizer_from_saved
from megatron_lite.models.hf import (
    MTP,
    _arch,
    architecture_for,
    check_exportable,
    config_from_hf,
    hf_config_dict,
    listed_architecture,
)
from megatron_lite.models.hf_decilm import DECILM, exported_auto_map, remote_code_files
from megatron_lite.models.hf_decilm import MODEL_TYPE as DECILM_TYPE
from megatron_lite.models.hf_deepseek import rope_interleave_of
from megatron_lite.models.hf_gpt_oss import GPT_OSS, dequantize_experts
from megatron_lite.models.hf_llama4 import LLAMA4, LLAMA4_VLM
from megatron_lite.models.hf_weights import state_dict_from_hf, state_dict_to_hf
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.training.configs import JobConfig


# Hugging Face side -------------------------------------------------------------------------------
def load_hf_config(path: str) -> tuple[Any, dict]:
    """(config object, raw config.json) of a Hugging Face model directory. With transformers installed its
    own config class reads the file (exact defaults); without it, config.json over hf_defaults.HF_DEFAULTS."""
    check_hf_model_dir(path)
    cfg_path = os.path.join(path, "config.json")
    raw = read_json_object(cfg_path, "download it again", "a JSON object of the model's settings")
    archs = raw.get("architectures") or [None]
    if archs[0] == DECILM or raw.get("model_type") == DECILM_TYPE:
        # Llama-Nemotron's DeciLM is remote code only, and a download names it (auto_map, configuration_decilm.py):
        # AutoConfig would ask to run it ("[y/N]", then fail). Read over no class's defaults, as its config.json
        # writes them all; its code is never run.
        return _fallback_config(raw), raw
    try:
        from transformers import AutoConfig
    except ImportError:
        return _fallback_config(raw), raw
    try:
        return AutoConfig.from_pretrained(path), raw
    except (ValueError, KeyError) as e:
        # A model type transformers does not know (Kimi-K2's "kimi_k2", shipped as remote code) of a DeepSeek
        # class we convert: its config.json over that class's defaults. Any other failure stays an error.
        from transformers import CONFIG_MAPPING

        deepseek = archs[0] in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
        if not deepseek or raw.get("model_type") in CONFIG_MAPPING:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{cfg_path}: transformers cannot read it ({first})") from e
        return _fallback_config(raw), raw
    except Exception as e:  # noqa: BLE001 - any other failure of transformers' reader is one line too
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{cfg_path}: transformers cannot read it ({type(e).__name__}: {first})") from None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --target-dtype


# megatron_lite side ------------------------------------------------------------------------------
def write_model_checkpoint(root: str, tensors: dict[str, torch.Tensor], job_dict: dict, extra: dict) -> str:
    """Weights only (no optimizer state), one piece per tensor, at iteration 0, files of at most 5 GiB."""
    tmp = iteration_dir(root, 0) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = shards({f"model/{name}@0": t for name, t in tensors.items()})
    index = {}
    for i, shard in enumerate(files):
        for key, t in shard.items():
            index[key.removesuffix("@0")] = {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "pieces": [
                    {
                        "file": f"tensors_r00000_{i:03d}.safetensors",
                        "key": key,
                        "starts": [0] * t.ndim,
                        "lengths": list(t.shape),
                    }
                ],
            }
    digests = {}
    for i, shard in enumerate(files):
        fname = f"tensors_r00000_{i:03d}.safetensors"
        atomic_write(os.path.join(tmp, fname), lambda p, s=shard: save_file(s, p))
        digests[fname] = file_digest(os.path.join(tmp, fname))
    atomic_write_json(os.path.join(tmp, "index_r00000.json"), {"tensors": index, "files": digests})
    meta = {
        "format": FORMAT,
        "iteration": 0,
        "consumed_samples": 0,
        "consumed_valid_samples": 0,
        "config": job_dict,
        "layout": {"world_size": 1},
        "scheduler": None,
        "grad_scaler": None,
        "adam_step": 0,
        **extra,
    }
    return publish(root, tmp, meta)


def read_model_tensors(load_dir: str, main: bool = False, base: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, full unpadded model tensors by our names) of the newest checkpoint under `load_dir`,
    whatever layout wrote it. A LoRA checkpoint of adapters has its frozen weights from the base checkpoint it
    recorded (QLoRA's: unquantised; `base` False: the adapters alone). `main`: the optimizer's fp32 main weights
    where it holds them (a --bf16 run's model weights are their bf16 rounding)."""
    path = find_checkpoint(load_dir, flag="--load-dir")
    if path is None:
        raise ConfigError(f"--load-dir {load_dir} holds no megatron_lite checkpoint")
    meta = read_metadata(path)
    reader = Reader(path, meta)
    out = {}
    lora = (meta["config"].get("lora") or {}) if base else {}
    if lora.get("base"):
        where = lora_base_checkpoint(lora["base"], f"--load-dir {load_dir}", lora.get("base_fingerprint"))
        out = read_model_tensors(where, main)[1]
    for name in list(reader.index):
        if name.startswith("model/"):
            name = "main/" + name.removeprefix("model/") if main and "main/" + name[6:] in reader.index else name
            out[name.split("/", 1)[1]] = reader.read_full(name)
    return meta, out


# The two directions ------------------------------------------------------------------------------
def hf_to_megatron_lite(load_dir: str, save_dir: str, log=print) -> str:
    check_save_dir(save_dir)
    hf_config, raw = load_hf_config(load_dir)
    arch = _arch(hf_config)
    config = config_from_hf(hf_config)
    log(f"{load_dir}: {arch}, {config.num_layers} layers, hidden {config.hidden_size}, vocabulary {config.vocab_size}")
    if (listed := listed_architecture(hf_config)) is not None:  # (transformers builds the model_type's class too)
        log(f"{load_dir}: config.json lists {listed} but its model_type {hf_config.model_type} builds {arch}: "
            f"converted as {arch}, as transformers' AutoModelForCausalLM loads it")  # fmt: skip
    hf = normalize_hf_names(read_hf_tensors(load_dir), arch)
    arch = LLAMA4 if arch == LLAMA4_VLM else arch  # (its text model, which exports as Llama4ForCausalLM)
    if arch == GPT_OSS:  # (the Hub's gpt-oss experts are MXFP4: dequantised exactly)
        hf = dequantize_experts(hf, log)
    check_not_quantised(hf, raw, load_dir, log)
    # DeepSeek-V3's and GLM-4-MoE's multi-token-prediction layers follow the last layer. (transformers' configs
    # default num_nextn_predict_layers to 1 and their models have none, so the file and the tensors decide.)
    mtp = int(raw.get("num_nextn_predict_layers") or 0) if arch in MTP else 0
    present = {_layer_of(k) for k in hf} - {None}
    if mtp and max(present, default=-1) < config.num_layers:
        log(f"{load_dir}: config.json has num_nextn_predict_layers {mtp} but no such layers: converted without them")
        mtp = 0
    missing = [config.num_layers + k for k in range(mtp) if config.num_layers + k not in present]
    if missing:
        raise ConfigError(
            f"{load_dir}: config.json has num_nextn_predict_layers {mtp} but the files lack layer(s) {missing}; "
            "set num_nextn_predict_layers to the depths present (0 converts without them)"
        )
    config = dataclasses.replace(config, mtp_num_layers=mtp)
    interleave = bool(getattr(hf_config, "rope_interleave", True))  # (DeepSeek-V3's RoPE row layout)
    check_hf_shapes(hf, config, arch, load_dir, interleave)
    with mapping_errors(load_dir):
        ours = state_dict_from_hf(hf, config, arch, interleave)
    ours = check_state_dict(ours, config, load_dir, log)
    _check_tied_output(hf, ours, config, load_dir)
    _check_mtp_copies(hf, config, load_dir, log)
    # (empty tensors hold nothing: transformers saves DeepSeek-V3's zero-width shared expert at n_shared_experts 0)
    unused = {k for k in set(hf) - _used_hf_names(hf, config, arch, interleave) if hf[k].numel()}
    if unused:
        raise ConfigError(f"{load_dir} holds tensors the {arch} mapping does not use: {sorted(unused)[:5]}")
    trained = [i for i in complete_iterations(save_dir) if i != 0] if os.path.isdir(save_dir) else []
    if trained:  # (iteration 0 would become the newest: a resume would go back to the converted weights)
        raise ConfigError(f"--save-dir {save_dir} holds a training run's checkpoints (iterations {trained[:3]}): "
                          "give an empty directory")  # fmt: skip
    # The source's side files (config, tokenizer...) go to save_dir/hf, replacing an earlier conversion's whole
    # (its tokenizer would be named by this one): made beside it, swapped in once the checkpoint is published.
    side = os.path.join(save_dir, HF_DIR)
    new_side = side + ".tmp"
    shutil.rmtree(new_side, ignore_errors=True)
    os.makedirs(new_side)
    code = remote_code_files(load_dir) if arch == DECILM else ()  # (kept for the export, not run)
    copy_side_files([(load_dir, ("config.json", *SIDE_FILES, *code))], new_side)
    tokenizer = os.path.join(os.path.abspath(side), "tokenizer.json")
    data = (
        DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer)
        if os.path.isfile(os.path.join(new_side, "tokenizer.json"))
        else DataConfig()
    )
    seq = min(config.max_position_embeddings, 4096)
    job = JobConfig(
        model=config,
        parallel=ParallelConfig(),
        training=TrainingConfig(seq_length=seq),
        optimizer=OptimizerConfig(),
        data=data,
    )
    source = {"hf": arch, "path": os.path.abspath(load_dir)}  # (the PEFT export's base_model_name_or_path)
    path = write_model_checkpoint(save_dir, ours, job.to_dict(), {"converted_from": source})
    replace_dir(new_side, side)
    log(f"wrote {path}: {len(ours)} tensors")
    return path


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _check_mtp_copies(hf: dict, config: ModelConfig, load_dir: str, log) -> None:
    """DeepSeek-V3 stores each MTP depth's embedding and output head as copies of the model's; MTP shares the
    model's here, so a copy that differs is reported (and not converted)."""
    for k in range(config.mtp_num_layers):
        p = f"model.layers.{config.num_layers + k}."
        head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
        for copy, original in (
            (p + "embed_tokens.weight", hf["model.embed_tokens.weight"]),
            (p + "shared_head.head.weight", head),
        ):
            if copy in hf and not torch.equal(hf[copy], original):
                log(f"{load_dir}: {copy} differs from the model's own; multi-token prediction uses the model's")


def _check_tied_output(hf: dict, ours: dict, config: ModelConfig, load_dir: str) -> None:
    """A tied model's files may hold lm_head.weight too: the embedding's copy, which the tie makes redundant. One
    that differs was dropped without a word, yet transformers 5 then unties them and computes with it (4.x tied
    over it): which output layer was meant, only the user knows."""
    head, embedding = hf.get("lm_head.weight"), ours.get("embedding.word_embeddings.weight")
    if config.untie_embeddings_and_output_weights or head is None or embedding is None:
        return
    if head.shape != embedding.shape or not torch.equal(head.to(embedding.dtype), embedding):
        raise ConfigError(
            f"{load_dir}: config.json ties the output layer to the word embeddings (tie_word_embeddings true) but "
            "its lm_head.weight differs from them (transformers 5 then computes with lm_head, untied); set "
            "tie_word_embeddings to false to convert both"
            + ("" if config.hybrid else ", or drop lm_head.weight from the files to tie them")
            + (" (NemotronHForCausalLM computes with lm_head.weight, tied or not)" if config.hybrid else "")
        )


def _used_hf_names(hf: dict, config: ModelConfig, arch: str, interleave: bool = True) -> set[str]:
    """The HF names the mapping reads: the inverse mapping's names, plus the fused-module alternatives."""
    ours = state_dict_from_hf(hf, config, arch, interleave)
    names = set(state_dict_to_hf(ours, config, arch, on_disk=True, rope_interleave=interleave))
    names |= set(state_dict_to_hf(ours, config, arch, rope_interleave=interleave))
    # Buffers some exports include: rotary inverse frequencies and GPT-2's causal-mask buffers.
    names |= {k for k in hf if k.endswith(("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias"))}
    return names


def saved_lora_config(saved: dict):
    """The LoraConfig a checkpoint was trained with (its metadata's `config`), or None without LoRA."""
    from megatron_lite.lora.config import LoraConfig

    lora = saved.get("lora")
    if not lora:
        return None
    return LoraConfig(lora["rank"], lora["alpha"], lora["dropout"], tuple(lora["target_modules"]),
                      lora.get("qlora", False), lora.get("base"), lora.get("base_fingerprint"))  # fmt: skip


def _original_hf_config(load_dir: str, saved: dict) -> tuple[dict, str | None]:
    """(the config.json a converted checkpoint came with, the hf/ directory it lies in); ({}, None) without."""
    side = hf_side(load_dir, saved)
    return read_hf_config(side), side


def _generation_json(side: str | None) -> dict | None:
    path = os.path.join(side, "generation_config.json") if side else None
    return read_json_object(path) if path and os.path.isfile(path) else None


def generation_config(load_dir: str, saved: dict) -> dict | None:
    """A converted checkpoint's generation_config.json (None without one)."""
    return _generation_json(_original_hf_config(load_dir, saved)[1])


def generation_eos_ids(load_dir: str, saved: dict) -> list[int]:
    """The ids transformers' generate stops at for a converted checkpoint: its generation_config.json's
    eos_token_id, else its config.json's (one id or a list, as Llama-3-Instruct's two end tokens); [] without."""
    config, side = _original_hf_config(load_dir, saved)
    gen = _generation_json(side)
    eos = (gen if gen is not None else config).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        where = "generation_config.json" if gen is not None else "config.json"
        raise ConfigError(
            f"{os.path.join(side or load_dir, where)}: eos_token_id {eos!r} is not a token id or a list of them; "
            "restore it from the model it came from"
        )
    return list(ids)


def megatron_lite_to_peft(
    load_dir: str, save_dir: str, log=print, base_model: str | None = None, dtype: str | None = None
) -> None:
    """The checkpoint's LoRA adapters as a PEFT adapter directory (onto the Hugging Face base it came from).
    Its base_model_name_or_path, which AutoPeftModelForCausalLM loads, is `base_model` (a hub name), else the
    directory the base was converted from. `dtype`: the adapter tensors' (default: as stored)."""
    from megatron_lite.lora.peft import split_lora, to_peft, write_peft

    check_save_dir(save_dir)
    # (the adapters alone: a 70B base is not read for them; a dtype asked for is cast from the fp32 main weights
    # where the checkpoint holds them, as --saver hf does, not from a --bf16 run's rounding of them)
    meta, ours = read_model_tensors(load_dir, main=dtype is not None, base=False)
    saved = meta["config"]
    lora = saved_lora_config(saved)
    if lora is None:
        raise ConfigError(f"--load-dir {load_dir}: the checkpoint was not trained with LoRA (--lora-rank)")
    config = model_config_from_dict(saved["model"])
    original, side = _original_hf_config(load_dir, saved)
    arch = architecture_for(config, (original.get("architectures") or [None])[0])  # (a Phi-3 stays a Phi-3)
    # (onto the base they came from, whose RoPE rows a rope_interleave=false DeepSeek-V3 keeps as ours)
    interleave = rope_interleave_of(arch, original)
    tensors, adapter_config = to_peft(split_lora(ours)[1], config, lora, arch, rope_interleave=interleave)
    if dtype:
        tensors = {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}  # (as the base's export)
    # (the Hugging Face model only while the adapters' base holds its weights unchanged: a base fine-tuned after
    # the conversion scored 0.45 off in log-probability under AutoPeftModelForCausalLM)
    origin = checkpoint_origin(find_checkpoint(load_dir), meta) or {}
    source = origin.get("converted_from")
    source = source if has_hf_config(source) else None  # (still there)
    base = base_model or (source if origin.get("converted_weights") else None)
    adapter_config["base_model_name_or_path"] = base
    write_peft(save_dir, tensors, adapter_config)
    log(f"wrote {save_dir}: PEFT LoRA adapter, rank {lora.rank}, {len(tensors)} tensors, iteration {meta['iteration']}")
    if lora.dropout and adapter_config["lora_dropout"] != lora.dropout:
        log(
            f"lora_dropout 0.0 written for the trained --lora-dropout {lora.dropout}: PEFT takes no dropout on expert "
            "adapters; outputs are the same (dropout is off at inference), training on in PEFT runs without it"
        )
    if base is None and source is not None:
        log(
            f"base_model_name_or_path null: the adapters' base ({lora.base or load_dir}) is not "
            f"{source} as converted (its weights were trained since); export that base with --saver hf and pass "
            "its directory as --base-model-name-or-path"
        )
    elif base is None:
        log(
            "no base model recorded (not converted from a Hugging Face directory here, or that directory is gone): "
            "PeftModel.from_pretrained loads it onto a base you give; --base-model-name-or-path names one for "
            "AutoPeftModelForCausalLM"
        )


def _token_ids(data: dict) -> dict:
    """config.json's bos/eos ids for the tokenizer a model was trained with (its EOD ends generation)."""
    try:
        tok = tokenizer_from_saved(data)
    except (ConfigError, ValueError, OSError):
        return {}
    return {"bos_token_id": getattr(tok, "bos", None), "eos_token_id": getattr(tok, "eod", None)}


def megatron_lite_to_hf(
    load_dir: str, save_dir: str, dtype: str | None = None, log=print, merge_lora: bool = False
) -> None:
    # (a dtype asked for is cast from the fp32 main weights where the checkpoint holds them, not their rounding)
    check_save_dir(save_dir)
    meta, ours = read_model_tensors(load_dir, main=dtype is not None)
    saved = meta["config"]
    config = model_config_from_dict(saved["model"])
    adapters = any(".lora." in k for k in ours)
    if merge_lora and not adapters:
        raise ConfigError(f"--merge-lora: --load-dir {load_dir} holds no LoRA adapters; drop --merge-lora")
    if adapters:
        lora = saved_lora_config(saved)
        if not merge_lora or lora is None:
            raise ConfigError(
                f"--load-dir {load_dir} holds LoRA adapters: add --merge-lora to fold them into the weights, or "
                "use --saver hf-peft to write the adapter alone"
            )
        from megatron_lite.lora.peft import merge

        if lora.base:  # (read_model_tensors took the frozen weights from the base the adapters recorded)
            kind = "QLoRA adapters onto the unquantised" if lora.qlora else "LoRA adapters onto the"
            log(f"merging the {kind} base {lora.base}")
        ours = merge(ours, config, lora)
    original, side = _original_hf_config(load_dir, saved)
    gone = (saved.get(ORIGIN) or {}).get("hf_dir")
    if side is None and gone:  # (recorded, then moved or deleted with its checkpoint)
        log(
            f"the Hugging Face files the weights were converted with, {gone}, are gone: config.json is written from "
            "the model's settings (head_dim, use_cache, ... at transformers' defaults), no generation_config.json"
        )
    base, side_from = None, [side] if side else []
    arch = architecture_for(config, (original.get("architectures") or [None])[0])  # back to the weights' class
    if (original.get("architectures") or [None])[0] == arch:
        base = original
    side_from = [(d, SIDE_FILES) for d in side_from]
    data = saved.get("data") or {}
    if trained_on_embedded_corpus(meta, config.vocab_size):  # (the quick start's demo: its tokenizer goes along)
        data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": build_embedded_corpus(log=log)[1]}
        log(f"tokenizer: the embedded corpus's, {data['tokenizer_model']} (the job trained on that corpus)")
    tok = data.get("tokenizer_model")
    # (the converted checkpoint, moved: its own hf/ tokenizer, as it was recorded; one of another place, gone, is
    # not replaced by the original model's)
    recorded = meta.get("converted_from") or os.path.normpath(os.path.dirname(tok or "")) == os.path.normpath(
        (saved.get(ORIGIN) or {}).get("hf_dir") or "-"
    )
    if tok and os.path.isabs(tok) and not os.path.exists(tok) and side and recorded:
        if os.path.isfile(moved := os.path.join(side, os.path.basename(tok))):
            data = {**data, "tokenizer_model": (tok := moved)}
    made = None
    if data.get("tokenizer_type") == "TikTokenizer":
        made, side_from, ids = tiktoken_side_files(lambda: tokenizer_from_saved(data), tok, side_from, log)
        base = base or ids
    elif tok and os.path.isfile(tok):  # (its tokenizer files only: the directory may be another model's)
        side_from.append((os.path.dirname(tok), TOKENIZER_FILES))
        if base is None:  # a model trained from scratch: transformers' class defaults (1, 2) are not its tokens
            base = _token_ids(data)
    elif tok and os.path.isabs(tok) and not os.path.exists(tok):  # (a base moved: no tokenizer went, silently)
        # (nor the original model's from hf/ in place of the one trained with, gone: a review found it so)
        side_from = [(d, tuple(f for f in files if f not in TOKENIZER_FILES)) for d, files in side_from]
        log(
            f"no tokenizer written: the checkpoint's tokenizer {tok} no longer exists (its checkpoint moved?); copy "
            f"the tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) of the model into {save_dir}"
        )
    check_exportable(config, arch)  # (before the weights are mapped: a missing tensor was a KeyError traceback)
    if config.moe_expert_capacity_factor is not None:
        log(
            f"note: trained with --moe-expert-capacity-factor {config.moe_expert_capacity_factor:g}; {arch} never "
            "drops tokens, so its logits differ from ours wherever a batch overflows an expert's capacity"
        )
    ours = check_state_dict(ours, config, f"--load-dir {load_dir}", log, extra_ok=True, cause=EXPORT_CAUSE)
    with mapping_errors(f"--load-dir {load_dir}"):
        # (a rope_interleave=false base keeps its RoPE rows as ours: written back so, HF -> ours -> HF bit-exact)
        hf = state_dict_to_hf(ours, config, arch, on_disk=True, rope_interleave=rope_interleave_of(arch, base))
    if dtype is not None:
        target = DTYPES[dtype]
        hf = {k: v.to(target) for k, v in hf.items()}
    out_dtype = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    hf_config = hf_config_dict(config, arch, base, out_dtype)
    if arch == DECILM and (auto_map := exported_auto_map(base, code := remote_code_files(side))) is not None:
        # (remote code only: the download's modelling code and its auto_map go along, so the export opens as it did)
        hf_config["auto_map"] = auto_map
        side_from.append((side, code))
    try:
        write_hf_dir(save_dir, hf, hf_config, side_from)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    log(f"wrote {save_dir}: {arch}, {len(hf)} tensors ({out_dtype}) from iteration {meta['iteration']}")
