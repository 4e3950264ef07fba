"""The files of a Hugging Face model directory: its safetensors weights (read whole, written in shards of at
most 5 GiB with an index) and the files that are not weights but travel with them (tokenizer, chat template,
generation settings, licence)."""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_lite.checkpoint.atomic import atomic_write, atomic_write_json
from megatron_lite.config import ConfigError

SHARD_BYTES = 5 * 1024**3
# Files of a Hugging Face model directory that are not weights and travel with them: the tokenizer's (the chat
# template is its own file since transformers 4.47), then the model's generation settings and licence terms.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE",
              "USE_POLICY.md")  # fmt: skip


# A PEFT adapter is exported here (lora/peft.py), not imported: the way in for one trained elsewhere
PEFT_ADAPTER_FIX = (
    "megatron_lite does not import adapters: fold it into its base with PEFT (PeftModel.from_pretrained(base, "
    "dir).merge_and_unload().save_pretrained(merged)) and convert that"
)


def peft_adapter(path: str) -> str | None:
    """What a directory holding a PEFT adapter is, in a line with the fix, or None. (Beside a model's weights too:
    transformers' from_pretrained then puts the adapter on the base its adapter_config.json names.)"""
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None
    return f"{path} holds a PEFT adapter (adapter_config.json); {PEFT_ADAPTER_FIX}"


def check_hf_model_dir(path: str) -> None:
    """`path` (--load-dir) is a Hugging Face model directory: its config.json there, and no PEFT adapter."""
    if (adapter := peft_adapter(path)) is not None:
        raise ConfigError(f"--load-dir {adapter}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--load-dir {path} has no config.json; point it at a Hugging Face model directory")


def copy_side_files(side_from: list[tuple[str, tuple[str, ...]]], path: str) -> None:
    """Into `path`, from each (directory, names), the named files present there and not yet copied."""
    for src, names in side_from:
        for f in names:
            if os.path.isfile(os.path.join(src, f)) and not os.path.exists(os.path.join(path, f)):
                shutil.copyfile(os.path.join(src, f), os.path.join(path, f))


def read_hf_tensors(path: str) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(_weight_map(index).values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    elif any(f.endswith(".bin") for f in os.listdir(path)):
        raise ConfigError(
            f"{path} holds only pickled .bin weights; loading them could run code. Re-save them as safetensors "
            "(transformers: model.save_pretrained(dir, safe_serialization=True)) and convert that"
        )
    else:
        raise ConfigError(f"{path} has no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        full = os.path.join(path, f)
        try:
            with safe_open(full, framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
        except Exception as e:
            raise ConfigError(f"{full} cannot be read ({type(e).__name__}: {e})") from None
    return out


def read_json_object(
    path: str, fix: str = "restore it from the model it came from", what: str = "a JSON object"
) -> dict:
    """A JSON object from `path`, or one line naming the file and `fix` (a truncated download, a saved HTML page,
    a damaged file in a checkpoint's hf/: they were JSONDecodeError, KeyError and AttributeError tracebacks, or
    errors that named no file). `what`: the object, as the line names it."""
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not JSON ({e}); {fix}") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path} is not {what}; {fix}")
    return out


def _weight_map(index: str) -> dict[str, str]:
    """The index's tensor -> file map; one line where it is not one."""
    weight_map = read_json_object(index, "download it again").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index} has no weight_map of tensor names to files; download it again")
    return weight_map


def shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most SHARD_BYTES each (a larger tensor alone in its group)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    return shards


def check_save_dir(path: str) -> None:
    """A --save-dir that exists must be a directory (a file there was a FileExistsError traceback), and one that
    does not must be creatable (under a file it was a NotADirectoryError traceback, once the checkpoint was read)."""
    from megatron_lite.training.configs import check_output_path

    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--save-dir {path} is a file, not a directory: give a directory")
    check_output_path("--save-dir", path, is_dir=True)


def _is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) or bool(
        glob.glob(os.path.join(path, "model*.safetensors"))
    )


def write_hf_dir(
    path: str, tensors: dict[str, torch.Tensor], config: dict, side_from: list[tuple[str, tuple[str, ...]]]
) -> None:
    """safetensors shards (with an index when more than one), config.json and the side files: from each
    (directory, names) of `side_from` those present, the first directory holding one giving it.

    `path` may be new, empty, or a Hugging Face model directory (an earlier export, replaced); any other
    non-empty directory is refused rather than mixed with. Everything is written into a temporary directory
    inside it first and moved into place by renames at the end, so an interruption while the weights are
    written leaves an earlier export whole."""
    check_save_dir(path)
    is_source = any(os.path.realpath(src) == os.path.realpath(path) for src, _ in side_from)
    if os.path.isdir(path) and not is_source and not _is_model_dir(path):
        others = sorted(f for f in os.listdir(path) if not f.startswith("."))
        if others:
            raise ConfigError(
                f"--save-dir {path} holds files that are not a Hugging Face model ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}): give an empty directory, or an earlier export to replace"
            )
    tmp = os.path.join(path, ".export.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        groups = shards(tensors)
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        for fname, shard in zip(names, groups):
            atomic_write(os.path.join(tmp, fname), lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}))
        if len(groups) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {k: fname for fname, shard in zip(names, groups) for k in shard}
            atomic_write_json(
                os.path.join(tmp, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map},
            )
        copy_side_files(side_from, tmp)
        atomic_write_json(os.path.join(tmp, "config.json"), config)
        # The switch, renames only. An earlier export's weights go first: transformers reads model.safetensors
        # before an index and we read the index first, so a leftover of either kind would give the two different
        # weights beside the new config; its side files too (chat template, tokenizer...), unless this directory
        # is itself a source of them.
        stale = glob.glob(os.path.join(path, "model-*-of-*.safetensors"))
        stale += [os.path.join(path, f) for f in ("model.safetensors", "model.safetensors.index.json")]
        if not is_source:
            stale += [os.path.join(path, f) for f in SIDE_FILES]
        for f in stale:
            if os.path.isfile(f):
                os.remove(f)
        for f in sorted(os.listdir(tmp), key=lambda f: f == "config.json"):  # (config.json last)
            os.replace(os.path.join(tmp, f), os.path.join(path, f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tiktoken_side_files(build, tok: str, side_from: list, log) -> tuple[str, list, dict]:
    """An export's tokenizer files made from the TikTokenizer `build()` gives (its rank list `tok` has no Hugging
    Face files beside it) in a new temporary directory: (that directory, for the caller to remove once written;
    `side_from` with it first and without a converted model's own tokenizer files; config.json's bos/eos ids, {}
    where the tokenizer cannot be read)."""
    import tempfile

    made = tempfile.mkdtemp(prefix="tiktoken-hf-")
    try:
        tokenizer = build()
        written = tokenizer.hf_files(made)
        ids = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eod}
        why = "one of its ranks is the text of a special token"
    except (ConfigError, ValueError, OSError) as e:
        written, why, ids = False, str(e), {}
    # (none of a converted model's own tokenizer files: one of them beside these, its special_tokens_map.json say,
    # would name tokens this vocabulary lacks, which transformers adds at new ids)
    side_from = [(d, tuple(n for n in names if n not in TOKENIZER_FILES)) for d, names in side_from]
    if written:
        side_from.insert(0, (made, TOKENIZER_FILES))  # (the tokenizer it was trained with)
        log(f"tokenizer: {tok} (TikTokenizer), written as a Hugging Face tokenizer.json")
    else:
        log(f"note: the export has no tokenizer files: the TikTokenizer {tok} cannot be written as one ({why})")
    return made, side_from, ids
