"""tools/generate.py --prompts-file names a bad line by its line in the file: blank lines (which the reader
skips) are counted, so the line named is the one to fix."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from test_convert import convert, generate_cli  # (the tools, loaded by path once)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_lines")
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=50, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    argv = ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(root / "hf")]
    assert convert.main([*argv, "--save-dir", str(root / "ours")]) == 0
    return str(root / "ours")


def _word_tokenizer(root, word: str = "w") -> str:
    """A tokenizer.json in `root` of the tiny model's 50 ids, one word each (`word` + the id; the last the end of
    document), split at whitespace; its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"{word}{i}": i for i in range(50)}, unk_token=f"{word}0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"{word}49"}))
    return str(root / "tokenizer.json")


@pytest.mark.parametrize(
    "lines, named",
    [
        (['{"prompt_ids": [1, 2]}', "", "", "not json"], "line 4"),  # a malformed line after blank ones
        (['{"prompt_ids": [1, 2]}', "", '{"prompt_ids": [3]}', "", '{"prompt_ids": []}'], "line 5"),  # empty
        (["", '{"prompt_ids": [1, 99]}'], "line 2"),  # an id outside the vocabulary
        (['{"prompt_ids": [1]}', '{"prompt_ids": [true, false]}'], "line 2"),  # JSON booleans (a traceback)
    ],
)
def test_a_bad_prompts_file_line_is_named_by_its_line_in_the_file(tiny_checkpoint, tmp_path, capsys, lines, named):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert generate_cli.main(["--load", tiny_checkpoint, "--prompts-file", str(path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine's case")
def test_triton_where_it_cannot_run_is_refused_as_pretrain_refuses_it(tiny_checkpoint, capsys, monkeypatch):
    """--kernel-impl triton on a CPU without the Triton interpreter ran the PyTorch path without a word
    (pretrain_gpt.py refuses it in one line)."""
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert generate_cli.main([*argv, "--kernel-impl", "triton"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kernel-impl triton needs a CUDA GPU" in err[0], err
    assert generate_cli.main(argv) == 0  # (the default on a CPU: torch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs fp32 only (bf16 generated garbage ids)
    assert generate_cli.main([*argv, "--kernel-impl", "triton", "--bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no half-precision arithmetic" in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA GPUs")
def test_nccl_without_a_gpu_is_refused_as_pretrain_refuses_it(tiny_checkpoint, capsys):
    """--distributed-backend nccl on a CPU machine: an AttributeError traceback under torchrun (torch's device
    setup), ignored on one process; pretrain_gpt.py refuses it in one line."""
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--distributed-backend", "nccl"]
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--distributed-backend nccl needs CUDA GPUs" in err[0], err


def test_ranks_that_find_different_checkpoints_are_refused(tiny_checkpoint, tmp_path):
    """From a failure review: tensor-parallel ranks whose --load held different checkpoints (a node's copy lagging
    behind) mixed their shards into one set of logits without a word; pretrain_gpt.py refuses such ranks. Each rank
    says what differs, and the job exits 2 (not SIGABRT: the group is ended)."""
    import os
    import pathlib
    import shutil
    import subprocess
    import sys

    other = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, other)
    script = pathlib.Path(__file__).resolve().parents[1] / "tools" / "generate.py"
    wrapper = tmp_path / "per_rank.py"  # (rank 1 reads the copy: another file system's --load)
    wrapper.write_text(
        "import os, runpy, sys\n"
        f"sys.argv[1:1] = ['--load', {tiny_checkpoint!r} if os.environ['RANK'] == '0' else {str(other)!r}]\n"
        f"sys.argv[0] = {str(script)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(wrapper),
           "--prompt-ids", "1,2", "--max-new-tokens", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode != 0 and "SIGABRT" not in out.stderr, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "different configurations or see different files" in line]
    assert said and f"checkpoint: ranks [0]: '{tiny_checkpoint}" in said[0], out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr or "exitcode: 2" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize(
    "extra, said",
    [
        # the prompt's scores went nowhere: an empty line printed, exit 0
        (["--max-new-tokens", "0"], "--max-new-tokens 0 scores the prompt"),
        # the stop ids were dropped without a word
        (["--ignore-eos", "--stop-ids", "5"], "--ignore-eos generates --max-new-tokens whatever comes"),
        # (an exploratory run's: an empty list replaced the stop ids with none, as --ignore-eos, without a word)
        (["--stop-ids", ""], "--stop-ids '' is not a comma-separated list of token ids (one id between each comma)"),
        (["--stop-ids", "5,,6"], "--stop-ids '5,,6' is not a comma-separated list of token ids"),
        # torch's 'Overflow when unpacking long long', naming no flag
        (["--seed", str(2**64)], f"--seed {2**64} is outside the range a generator takes"),
        # the permission bits passed (root), then the write failed after the generation: a traceback, no output
        (["--output-json", "/proc/x/y.json"], "--output-json /proc/x/y.json: its directory /proc/x cannot be written"),
    ],
)
def test_flags_that_would_do_nothing_or_fail_are_one_line(tiny_checkpoint, capsys, extra, said):
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy", *extra]
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


def test_tokenizer_model_decodes_token_id_prompts_output(tiny_checkpoint, tmp_path, capsys):
    """--tokenizer-model with --prompt-ids was ignored without a word (a path that does not exist too): it now
    decodes the output, as it would a text prompt's, and a bad path is its own one line."""
    path = _word_tokenizer(tmp_path)
    out = tmp_path / "o.json"
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--greedy", "--ignore-eos"]
    assert generate_cli.main([*argv, "--tokenizer-model", path, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["text"] == " ".join(f"w{i}" for i in r["generated_ids"]), r
    assert capsys.readouterr().out.strip() == r["text"]
    missing = str(tmp_path / "none")
    assert generate_cli.main([*argv, "--tokenizer-model", missing]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--tokenizer-model {missing}: no such file" in err[0] and "checkpoint's" not in err[0], (
        err
    )


def test_a_prompts_file_too_long_for_learned_positions_names_its_line(tmp_path, capsys):
    """GPT-2's learned positions: the refusal named the longest prompt's length but not its line in the file."""
    config = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    argv = ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(tmp_path / "hf")]
    assert convert.main([*argv, "--save-dir", str(tmp_path / "ours")]) == 0
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [1, 2, 3, 4, 5, 6, 7]}\n{"prompt_ids": [3]}\n')
    capsys.readouterr()
    argv = ["--load", str(tmp_path / "ours"), "--prompts-file", str(path), "--max-new-tokens", "3", "--greedy"]
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "7 tokens (--prompts-file line 3)" in err[0] and "8 learned positions" in err[0], err


def test_a_prompts_file_prints_one_json_line_per_prompt(tiny_checkpoint, tmp_path, capsys):
    """Each prompt's text was printed as it was: a text holding a newline spread over several lines, so the
    output could not be matched to the prompts. Now one JSON line each, naming its line in the file."""
    _word_tokenizer(tmp_path, "a\nb")  # (every id: a newline)
    path, out = tmp_path / "p.jsonl", tmp_path / "o.json"
    path.write_text('{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [4, 5, 6]}\n')
    argv = ["--load", tiny_checkpoint, "--prompts-file", str(path), "--max-new-tokens", "3", "--greedy", "--ignore-eos"]
    assert generate_cli.main([*argv, "--tokenizer-model", str(tmp_path), "--output-json", str(out)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    written = json.loads(out.read_text())
    assert [p["line"] for p in printed] == [1, 3] and all("\n" in r["text"] for r in written), printed
    assert [(p["text"], p["generated_ids"]) for p in printed] == [(r["text"], r["generated_ids"]) for r in written]


def test_every_flag_says_what_it_does_in_help():
    """--help listed --temperature, --seed, --output-json, the parallel sizes and --distributed-backend without a
    word (what --output-json writes, or that the seed gives the same tokens at any layout, was only in the code)."""
    bare = [a.option_strings[0] for a in generate_cli.build_parser()._actions if not a.help]
    assert bare == [], bare


def test_a_prompts_file_is_read_as_utf8(tiny_checkpoint, tmp_path, capsys):
    """JSONL is UTF-8: the file was read in the locale's encoding, so a byte-order mark (Windows editors write one)
    made line 1 'not {"prompt": text}', and bytes that are not UTF-8 were a decoder's message naming neither the
    file nor the line."""
    path, out = tmp_path / "p.jsonl", tmp_path / "o.json"
    argv = ["--load", tiny_checkpoint, "--prompts-file", str(path), "--max-new-tokens", "2", "--greedy"]
    path.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [1, 2], "note": "caf\xc3\xa9"}\n')
    assert generate_cli.main([*argv, "--output-json", str(out)]) == 0
    assert [r["prompt_ids"] for r in json.loads(out.read_text())] == [[1, 2]]
    path.write_bytes(b'{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [3], "note": "caf\xe9"}\n')  # (latin-1)
    capsys.readouterr()
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--prompts-file {path} line 3: not UTF-8" in err[0], err


def test_layers_that_do_not_split_evenly_generate_under_an_uneven_pipeline(tmp_path):
    """A checkpoint whose layers do not divide by the pipeline size (DeepSeek-V3's 61) could not generate under
    any pipeline size but 1 and itself; Megatron's --decoder-first/last-pipeline-num-layers now split it, and the
    result equals one process's."""
    import os
    import pathlib
    import subprocess
    import sys

    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=50, max_position_embeddings=32, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    argv = ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(tmp_path / "hf")]
    assert convert.main([*argv, "--save-dir", str(tmp_path / "ours")]) == 0
    argv = [
        "--load",
        str(tmp_path / "ours"),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "5",
        "--greedy",
        "--ignore-eos",
    ]
    assert generate_cli.main([*argv, "--output-json", str(tmp_path / "one.json")]) == 0
    script = pathlib.Path(__file__).resolve().parents[1] / "tools" / "generate.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *argv,
           "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
           "--output-json", str(tmp_path / "pp2.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    one, pp2 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "pp2"))
    assert pp2["generated_ids"] == one["generated_ids"]
    assert torch.allclose(torch.tensor(pp2["logprobs"]), torch.tensor(one["logprobs"]), atol=1e-5)


def test_without_top_k_or_top_p_the_most_likely_token_is_taken(tiny_checkpoint, tmp_path, capsys):
    """Megatron's inference takes --top_k 1 unless --top_p is set, and transformers' generate() is greedy unless
    told to sample; this tool sampled at temperature 1 without either flag, so a ported script got other tokens.
    Now the same tokens as --greedy (a temperature alone is said to have no effect), and --top-p or --top-k 0
    sample."""
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--ignore-eos"]

    def tokens(*extra):
        out = tmp_path / "o.json"
        assert generate_cli.main([*argv, *extra, "--output-json", str(out)]) == 0
        return json.loads(out.read_text())["generated_ids"]

    greedy = tokens("--greedy")
    capsys.readouterr()
    assert tokens() == greedy and tokens("--temperature", "0") == greedy
    assert "--temperature 0 has no effect: without --top-k or --top-p the most likely token" in capsys.readouterr().err
    assert tokens("--top-k", "0") != greedy and tokens("--top-p", "0.99") != greedy  # (seed 1234, near-uniform)


def test_megatrons_prompts_and_return_log_probs_are_taken(tiny_checkpoint, tmp_path, capsys):
    """Megatron's inference flags --prompts TEXT... and --return-log-probs were "did you mean --prompt?" and "no
    such flag": several text prompts now generate as --prompts-file's (one JSON line each, numbered), and
    --return-log-probs is said to have no effect (--output-json always holds the log-probabilities)."""
    common = ["--load", tiny_checkpoint, "--max-new-tokens", "3", "--greedy", "--ignore-eos"]
    common += ["--tokenizer-model", _word_tokenizer(tmp_path)]
    alone = []
    for ids in ("1,2,3", "4,5"):
        assert generate_cli.main([*common, "--prompt-ids", ids, "--output-json", str(tmp_path / "one.json")]) == 0
        alone.append(json.loads((tmp_path / "one.json").read_text())["generated_ids"])
    capsys.readouterr()
    out = tmp_path / "many.json"
    argv = [*common, "--prompts", "w1 w2 w3", "w4 w5", "--return-log-probs", "--output-json", str(out)]
    assert generate_cli.main(argv) == 0
    said = capsys.readouterr()
    lines = [json.loads(line) for line in said.out.strip().splitlines()]
    assert [(r["prompt"], r["generated_ids"]) for r in lines] == [(1, alone[0]), (2, alone[1])], said.out
    assert [r["prompt_ids"] for r in json.loads(out.read_text())] == [[1, 2, 3], [4, 5]]
    assert "--return-log-probs has no effect" in said.err, said.err


@pytest.mark.parametrize(
    "layout, said",
    [
        (["--tensor-model-parallel-size", "3"], "--num-attention-heads 2 is not divisible"),
        (["--expert-model-parallel-size", "3"], "--num-experts"),
    ],
)
def test_a_layout_the_checkpoint_does_not_fit_says_the_flag_is_the_checkpoints(
    tiny_checkpoint, capsys, monkeypatch, layout, said
):
    """The layout check names the model's flags (--num-attention-heads, --num-experts), which a generate.py user
    never gave: the line says they are the checkpoint's (before any process group)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy", *layout]
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the checkpoint's model does not fit this layout: " in err[0] and said in err[0], err


def test_a_kv_cache_larger_than_the_hosts_memory_is_one_line(tiny_checkpoint, capsys):
    """On a GPU a generation larger than the free memory was refused in one line; on a CPU it was the allocator's
    traceback ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 320000000096 bytes")."""
    argv = ["--load", tiny_checkpoint, "--prompt-ids", "1,2,3", "--max-new-tokens", str(10**10), "--greedy"]
    assert generate_cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and "x 10000000003 tokens" in err[0] and "do not fit" in err[0], err


def test_parallel_sizes_under_plain_python_say_how_to_launch(tmp_path, capsys, monkeypatch):
    """--tensor-model-parallel-size 2 under plain python said "the checkpoint's model does not fit this layout:
    world size 1 is not divisible ...", blaming the checkpoint: it says to launch with torchrun."""
    from test_pretrain_cli import TINY

    from megatron_lite.training.pretrain import main as pretrain

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    ckpt = str(tmp_path / "ckpt")  # (4 heads: TP=2 fits it; the converted one above has a single query group)
    assert pretrain([*TINY, "--mock-data", "--vocab-size", "100", "--train-iters", "1", "--save", ckpt]) == 0
    capsys.readouterr()
    argv = ["--load", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy"]
    assert generate_cli.main([*argv, "--tensor-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tensor-model-parallel-size 2 splits the model over 2 "), err
    assert "launch with torchrun --nproc-per-node 2 tools/generate.py" in err[0] and "does not fit" not in err[0], err


def test_experts_that_need_more_ranks_than_launched_name_this_tools_flags(tmp_path, capsys, monkeypatch):
    """An exploratory run's finding: TP=2 with EP=2 on 2 ranks said "world size 2 is not divisible by
    --expert-tensor-parallel-size 2 x --expert-model-parallel-size 2", a training flag this tool has not (a smaller
    expert-TP needs sequence parallelism, which decoding has not)."""
    from test_pretrain_cli import TINY

    from megatron_lite.training.pretrain import main as pretrain

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    ckpt = str(tmp_path / "ckpt")
    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    assert pretrain([*TINY, *moe, "--mock-data", "--vocab-size", "100", "--train-iters", "1", "--save", ckpt]) == 0
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--load", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy"]
    assert generate_cli.main([*argv, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the experts take 4 ranks, which the 2 launched do not divide" in err[0], err
    assert "--expert-tensor-parallel-size" not in err[0], err


def test_megatrons_other_names_for_the_batch_are_taken(tiny_checkpoint, tmp_path, capsys):
    """Megatron's --inference-max-batch-size (the dest of --inference-max-requests there) and its server's older
    --max-batch-size were "no such flag (Megatron-LM flags we implement keep their names)"; --out-seq-length, its
    older generation flag, now names the one to use."""
    for flag in ("--inference-max-batch-size", "--max-batch-size"):
        args = generate_cli.build_parser().parse_args(["--load", tiny_checkpoint, "--prompt-ids", "1", flag, "3"])
        assert args.inference_max_requests == 3
    with pytest.raises(SystemExit):
        generate_cli.main(["--load", tiny_checkpoint, "--prompt-ids", "1", "--out-seq-length", "8"])
    assert "--out-seq-length: no such flag in" in (err := capsys.readouterr().err) and "use --max-new-tokens" in err
