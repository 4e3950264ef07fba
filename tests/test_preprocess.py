"""tools/preprocess_data.py: JSONL and text files to an indexed dataset that decodes back to the input."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from megatron_lite.data.embedded import build_embedded_corpus
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.tokenizers import HuggingFaceTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [{"text": f"def f{i}(x):\n    return x * {i}  # doc {i} é", "meta": i} for i in range(300)]


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_round_trip(tmp_path, workers):
    _, tok_path = build_embedded_corpus()
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tok_path,
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "processed 100 documents" in out.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = HuggingFaceTokenizer(tok_path)
    assert len(ds) == len(DOCS)
    for i in (0, 17, 299):
        ids = list(ds.get(i))
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == DOCS[i]["text"]


def test_the_tool_and_its_workers_import_no_torch():
    """A --workers process (spawned) imports the tool's file anew: it imported torch through the dataset writer's
    module, seconds per worker on a small machine (--workers 8, docs/training.md's example, took 45-95 s for 219
    documents on 2 loaded cores, 0.3 s with one worker); the tokenizer needs none of it. Nor does the writer: the
    tool's own start took 2.6 s here with torch, 0.5 s without."""
    tool = str(ROOT / "tools" / "preprocess_data.py")
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('__mp_main__', {tool!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "from megatron_lite.data.indexed import IndexedDatasetWriter; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)


def test_bad_json_key_is_one_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"body": "x"}) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "ByteLevelTokenizer",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().startswith("error:") and "--json-keys" in out.stderr


def _sentencepiece_folder(folder: pathlib.Path, with_json: bool = True) -> pathlib.Path:
    """A Llama-style tokenizer folder: tokenizer.model (SentencePiece; we never read it) and, when asked,
    the Hugging Face tokenizer.json converted from it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(b"\x0a\x00")
    if with_json:
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(["<unk>", "<s>", "</s>"])  # (as a converted Llama tokenizer.json lists them)
        tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.model"


def test_megatron_sentencepiece_tokenizers_read_the_tokenizer_json_beside_the_model(tmp_path):
    """Llama2Tokenizer puts a BOS before every document and ends documents with </s>; GPTSentencePieceTokenizer
    has no BOS. Both take the .model path a Megatron script passes."""
    from megatron_lite.config import ConfigError
    from megatron_lite.data.tokenizers import build_tokenizer

    model = _sentencepiece_folder(tmp_path / "llama")
    llama = build_tokenizer("Llama2Tokenizer", model=str(model))
    assert llama.encode("w0 w5") == [1, 3, 8] and llama.encode_batch(["w1"]) == [[1, 4]]
    assert llama.eod == 2 and llama.vocab_size == 43
    gpt_sp = build_tokenizer("GPTSentencePieceTokenizer", model=str(tmp_path / "llama"))  # the folder works too
    assert gpt_sp.encode("w0 w5") == [3, 8] and gpt_sp.eod == 2
    # From a review: "</s>" or "<s>" written in a document is text to SentencePiece (Megatron's tokenizers), not
    # an EOD or BOS mid-document (tokenizers matched them as the special tokens: [1, 3, 1, 4, 2, 5])
    import pickle

    for tok, prefix in ((llama, [1]), (gpt_sp, [])):
        ids = tok.encode("w0 <s>w1</s> w2")
        assert ids[: len(prefix)] == prefix and not {1, 2} & set(ids[len(prefix) :]), ids
        assert pickle.loads(pickle.dumps(tok)).encode("w0 <s>w1</s> w2") == ids  # (a pickled Tokenizer lost it)
    bare = _sentencepiece_folder(tmp_path / "bare", with_json=False)
    with pytest.raises(ConfigError, match="found none at .*tokenizer.json") as e:
        build_tokenizer("Llama2Tokenizer", model=str(bare))
    assert "\n" not in str(e.value)


def _llama3_style_folder(folder: pathlib.Path, eos: str | None) -> str:
    """A tokenizer.json whose post-processor puts <|begin_of_text|> before the text (as Llama-3's does), and a
    tokenizer_config.json naming `eos` its eos_token (none when None)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<｜end▁of▁sentence｜>"]
    vocab = {**{f"w{i}": i for i in range(8)}, **{t: 8 + i for i, t in enumerate(specials)}, "<unk>": 12}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 8)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": eos}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(folder / "tokenizer.json")


@pytest.mark.parametrize("in_map", [False, True])
def test_the_eos_of_special_tokens_map_json_is_the_end_of_document(tmp_path, in_map):
    """A special_tokens_map.json's eos_token is transformers' eos_token_id (Megatron's eod), over the
    tokenizer_config.json's where both name one: the map alone had been ignored, and a candidate taken."""
    transformers = pytest.importorskip("transformers")
    from megatron_lite.data.tokenizers import build_tokenizer

    path = _llama3_style_folder(tmp_path / "tok", None if in_map else "<|end_of_text|>")
    if in_map:
        (tmp_path / "tok" / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    else:  # both: the map wins
        (tmp_path / "tok" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert build_tokenizer("HuggingFaceTokenizer", model=path).eod == theirs.eos_token_id == 10


def test_a_model_directory_is_a_tokenizer_model(tmp_path):
    """--tokenizer-model DIR (a Hugging Face model directory, as Megatron takes) stands for DIR/tokenizer.json,
    for the tokenizer and in the run's config (what conversion reads back); it was refused."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.data.tokenizers import build_tokenizer

    path = _llama3_style_folder(tmp_path / "tok", "<|eot_id|>")
    assert build_tokenizer("HuggingFaceTokenizer", model=str(tmp_path / "tok")).eod == 10
    flags = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data"
    _, job = parse_args(
        [*flags.split(), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]
    )
    assert job.data.tokenizer_model == path


def test_a_hub_id_in_the_local_cache_is_a_tokenizer_model(tmp_path, monkeypatch):
    """Megatron's scripts pass a hub id (AutoTokenizer.from_pretrained); it was "no such file". One already in the
    local Hugging Face cache reads its snapshot (with its tokenizer_config.json's eos); one not there says how
    to get it. Nothing is downloaded."""
    hub = pytest.importorskip("huggingface_hub")
    from megatron_lite.config import ConfigError
    from megatron_lite.data.tokenizers import build_tokenizer

    snapshot = tmp_path / "hub" / "models--org--tok" / "snapshots" / "abc123"
    _llama3_style_folder(snapshot, "<|eot_id|>")
    (tmp_path / "hub" / "models--org--tok" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tok" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", model="org/tok")
    assert tok.path == str(snapshot / "tokenizer.json") and tok.eod == 10
    with pytest.raises(ConfigError, match=r"org/other: no such file .* not in the local cache: download it first"):
        build_tokenizer("HuggingFaceTokenizer", model="org/other")
    for mistyped in ("../missing", "tok--dir/x", "toks/tokenizer.json"):  # (a traceback, or told to download)
        with pytest.raises(ConfigError, match=f"{re.escape(mistyped)}: no such file") as e:
            build_tokenizer("HuggingFaceTokenizer", model=mistyped)
        assert "hub id" not in str(e.value) or mistyped == "tok--dir/x"


@pytest.mark.parametrize("eos", ["<|eot_id|>", "<｜end▁of▁sentence｜>", None])
def test_huggingface_tokenizer_encodes_and_ends_documents_as_transformers(tmp_path, eos):
    """Megatron's HuggingFaceTokenizer encodes as transformers' tokenizer(text).input_ids (the post-processor's
    BOS included: without it a converted Llama-3 generated from another prompt), and its end-of-document id is
    transformers' eos_token_id (an instruct model's <|eot_id|>, DeepSeek's end-of-sentence token, which the
    candidate list lacked); without a tokenizer_config.json eos_token, the candidates still decide."""
    transformers = pytest.importorskip("transformers")
    from megatron_lite.data.sft import SFTDataset
    from megatron_lite.data.tokenizers import build_tokenizer

    path = _llama3_style_folder(tmp_path / "tok", eos)
    ours = build_tokenizer("HuggingFaceTokenizer", model=path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert ours.encode("w1 w2 w3") == theirs("w1 w2 w3").input_ids == [8, 1, 2, 3]
    assert ours.encode_batch(["w4", "w5 w6"]) == [theirs(t).input_ids for t in ("w4", "w5 w6")]
    assert ours.eod == (theirs.eos_token_id if eos else 9)  # <|end_of_text|>, the first candidate it holds
    records = tmp_path / "sft.jsonl"
    records.write_text(json.dumps({"prompt": "w1 w2", "response": "w3"}) + "\n")
    sample = SFTDataset(str(records), ours, 8, seed=0)[0]
    assert sample["tokens"].tolist().count(8) == 1  # one BOS per sequence, the prompt's


def test_megatron_mixtral_example_flags_parse(tmp_path):
    """The flags of Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (with --moe-grouped-gemm,
    commented out there, switched on), unchanged: a Megatron user ports the script by changing its entry point."""
    from megatron_lite.arguments import parse_args

    model = _sentencepiece_folder(tmp_path / "mixtral")
    flags = f"""--use-mcore-models --disable-bias-linear --seq-length 256 --max-position-embeddings 2048
        --num-layers 2 --hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 2 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
        --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
        --no-position-embedding --rotary-base 1000000 --num-experts 2 --moe-router-topk 2
        --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
        --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer --tokenizer-model {model} --mock-data --split 99990,8,2
        --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 7 --min-lr 1.0e-5 --weight-decay 0.1
        --clip-grad 1.0 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
        --expert-model-parallel-size 2 --use-distributed-optimizer --sequence-parallel --eval-iters 10
        --no-load-optim --no-load-rng"""
    _, job = parse_args(flags.split())
    assert job.model.num_experts == 2 and job.parallel.ep == 2 and job.data.tokenizer_type == "Llama2Tokenizer"


def test_empty_and_sentence_list_documents_follow_megatron(tmp_path):
    """Megatron's Encoder.encode: a list-valued text is the document's sentences, one sequence each, empty ones
    dropped; --append-eod ends the document's last sentence; an empty document has no EOD and no sequence, only
    a document boundary (IndexedDatasetBuilder.add_document with no lengths)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    src = tmp_path / "in.jsonl"
    texts = ["ab", "", "cd", ["ef", "", "g"], []]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "o")
    argv = ["--input", str(src), "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer", "--append-eod"]
    assert preprocess_data.main(argv) == 0
    ds = IndexedDataset(prefix + "_text_document")
    # bytes: a b c d e f g = 97..103; EOD 256
    assert [ds.get(i).tolist() for i in range(len(ds))] == [[97, 98, 256], [99, 100, 256], [101, 102], [103, 256]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 4, 4]
    # without --append-eod: the same sequences, no EOD
    assert preprocess_data.main([*argv[:3], prefix + "_no_eod", *argv[4:6]]) == 0
    ds = IndexedDataset(prefix + "_no_eod_text_document")
    assert [ds.get(i).tolist() for i in range(len(ds))] == [[97, 98], [99, 100], [101, 102], [103]]


def _preprocess(tmp_path, src: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    tool = str(ROOT / "tools" / "preprocess_data.py")
    argv = [sys.executable, tool, "--input", str(src), "--output-prefix", str(tmp_path / "o"), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_input_the_tokenizer_cannot_read_is_one_line(tmp_path):
    """Text that is not UTF-8 (read by the main process, also with workers), NullTokenizer text that is not ids
    or ids past its vocabulary (they overflowed the uint16 .bin): one line each, no traceback; a tokenizer.json
    the tokenizers library cannot parse likewise."""
    from megatron_lite.config import ConfigError

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps({"text": "ok"}).encode() + b'\n{"text": "caf\xe9"}\n')
    for workers in ("1", "2"):
        out = _preprocess(tmp_path, bad, "--tokenizer-type", "ByteLevelTokenizer", "--workers", workers)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "latin1.jsonl:2: not UTF-8 (byte 0xe9 at column 14)" in out.stderr, out.stderr
    for text, fragment in (("1 x 2", "space-separated token ids"), ("1 70000", "token id 70000 is outside")):
        src = tmp_path / "ids.jsonl"
        src.write_text(json.dumps({"text": text}) + "\n")
        out = _preprocess(tmp_path, src, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(ConfigError, match="is not a tokenizer.json the tokenizers library reads"):
        HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))


def test_an_output_prefix_that_cannot_be_written_is_one_line(tmp_path):
    """(From a review: a FileNotFoundError traceback from inside the writer.) Checked before any tokenising; a
    missing parent directory is made."""
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "ab"}) + "\n")
    (tmp_path / "file").write_text("")
    tool = str(ROOT / "tools" / "preprocess_data.py")
    for prefix, fragment in (
        (tmp_path / "file" / "o", f"--output-prefix {tmp_path}/file/o_text_document.bin cannot be created: "),
        ("/proc/megatron_lite/o", "--output-prefix /proc/megatron_lite/o: cannot write /proc/megatron_lite/o_text"),
    ):
        argv = [sys.executable, tool, "--input", str(src), "--output-prefix", str(prefix)]
        out = subprocess.run([*argv, "--tokenizer-type", "ByteLevelTokenizer"], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "new" / "o"),
                                 "--tokenizer-type", "ByteLevelTokenizer"]) == 0  # fmt: skip
    assert (tmp_path / "new" / "o_text_document.idx").exists()


def test_a_log_interval_below_one_is_one_line(tmp_path):
    """--log-interval 0 was a ZeroDivisionError traceback at the first document."""
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "ab"}) + "\n")
    argv = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
            str(tmp_path / "o"), "--tokenizer-type", "ByteLevelTokenizer", "--log-interval", "0"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True)
    said = "error: --log-interval 0 must be >= 1 (documents between progress lines)\n"
    assert out.returncode == 2 and out.stderr == said, out.stderr


def test_a_bad_document_is_named_by_its_line_also_with_workers(tmp_path):
    """With --workers 2 a document without the key was reported at the first document of its 64-document
    chunk (65 for line 100), and the workers went on through the whole input before the tool exited; a lone
    surrogate escaped in the JSON was blamed on --json-keys."""
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(1, 300)]
    lines[99] = json.dumps({"body": "no text key"})
    src.write_text("\n".join(lines) + "\n")
    out = _preprocess(tmp_path, src, "--tokenizer-type", "ByteLevelTokenizer", "--workers", "2")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "in.jsonl:100: no key 'text' in the document (check --json-keys)" in out.stderr, out.stderr
    # a later line that is not UTF-8 (read ahead by the pool's feeder) does not take the first error's place
    src.write_bytes(src.read_bytes().replace(b'"doc 120"', b'"doc \xe9"'))
    out = _preprocess(tmp_path, src, "--tokenizer-type", "ByteLevelTokenizer", "--workers", "2")
    assert out.returncode == 2 and "in.jsonl:100: no key 'text'" in out.stderr, out.stderr
    src.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "half an emoji \\ud83d"}\n')
    out = _preprocess(tmp_path, src, "--tokenizer-type", "ByteLevelTokenizer")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "in.jsonl:2: the text is not valid Unicode" in out.stderr and "--json-keys" not in out.stderr


def test_inputs_keep_their_order_and_megatrons_other_flags_are_said(tmp_path, capsys):
    """From a review: `--input b.jsonl a.jsonl` was written a then b (sorted), which moved documents between the
    --split parts; --partitions and --keep-sequential-samples were "no such flag"; --split-sentences said no more
    than that, and leaving it out changes what is written."""
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": f"from {name}"}) + "\n")
    prefix = str(tmp_path / "o")
    argv = ["--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer", "--partitions", "4"]
    files = [str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert preprocess_data.main(["--input", *files, *argv, "--keep-sequential-samples"]) == 0
    out = capsys.readouterr().out
    assert "--partitions 4" not in out and "more than once: each read once" in out
    ds = IndexedDataset(prefix + "_text_document")
    assert [bytes(ds.get(i).tolist()).decode() for i in range(len(ds))] == ["from b", "from a"]
    assert preprocess_data.main(["--input", files[0], *argv, "--split-sentences"]) == 2
    assert "--split-sentences: Megatron's NLTK sentence split is not implemented here" in capsys.readouterr().err
    # --lang and --keep-newlines shape that split alone: without it Megatron ignores them, and its scripts pass
    # --lang english (its default); they were refused as if the split had been asked for
    assert preprocess_data.main(["--input", files[0], *argv, "--lang", "english", "--keep-newlines"]) == 0
    again = IndexedDataset(prefix + "_text_document")
    assert [bytes(again.get(i).tolist()).decode() for i in range(len(again))] == ["from b"]


def test_gzipped_inputs_are_read_and_an_error_leaves_no_partial_files(tmp_path, capsys):
    """From a review: a .jsonl.gz (Megatron's tool reads them) was "not UTF-8 (byte 0x8b ...)", and any input error
    left PREFIX_text_document.bin.partial behind. A damaged .gz is one line too."""
    import gzip

    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    plain, packed = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    plain.write_text(json.dumps({"text": "plain"}) + "\n")
    packed.write_bytes(gzip.compress((json.dumps({"text": "packed"}) + "\n").encode()))
    prefix = str(tmp_path / "o")
    argv = ["--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
    assert preprocess_data.main(["--input", str(plain), str(packed), *argv]) == 0
    ds = IndexedDataset(prefix + "_text_document")
    assert [bytes(ds.get(i).tolist()).decode() for i in range(len(ds))] == ["plain", "packed"]
    text_gz = tmp_path / "doc.txt.gz"
    text_gz.write_bytes(gzip.compress(b"a text file"))
    assert preprocess_data.main(["--input", str(text_gz), *argv[:1], prefix + "2", *argv[2:], "--text-files"]) == 0
    assert bytes(IndexedDataset(prefix + "2_text_document").get(0).tolist()).decode() == "a text file"
    # (an exploratory run's: a text file's bytes that are not UTF-8 became U+FFFD without a word, a BOM was text)
    bom, latin1 = tmp_path / "bom.txt", tmp_path / "latin1.txt"
    bom.write_bytes(b"\xef\xbb\xbfbom text\r\n")
    latin1.write_bytes(b"first line\ncaf\xe9 latin1\n")
    assert preprocess_data.main(["--input", str(bom), *argv[:1], prefix + "_bom", *argv[2:], "--text-files"]) == 0
    assert bytes(IndexedDataset(prefix + "_bom_text_document").get(0).tolist()).decode() == "bom text\r\n"
    capsys.readouterr()
    assert preprocess_data.main(["--input", str(latin1), *argv[:1], prefix + "_latin", *argv[2:], "--text-files"]) == 2
    assert f"{latin1}:2: not UTF-8 (byte 0xe9 at column 4); convert the file to UTF-8" in capsys.readouterr().err
    capsys.readouterr()

    damaged = tmp_path / "c.jsonl.gz"
    damaged.write_bytes(packed.read_bytes()[:-12])  # (cut short: no end of stream)
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"body": "no text"}) + "\n")
    for inputs, fragment in (([str(plain), str(damaged)], "c.jsonl.gz: cannot be read"), ([str(bad)], "no key")):
        assert preprocess_data.main(["--input", *inputs, *argv[:1], prefix + "3", *argv[2:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err
        assert not list(tmp_path.glob("o3*")), list(tmp_path.glob("o3*"))


def test_an_index_with_megatrons_sequence_modes_reads(tmp_path):
    """Megatron's multimodal builder appends an int8 mode per sequence to the .idx, which its text reader skips;
    ours refused such an index as truncated or corrupt. Any other size still is."""
    from megatron_lite.config import ConfigError
    from megatron_lite.data.indexed import IndexedDatasetWriter

    prefix = str(tmp_path / "m")
    w = IndexedDatasetWriter(prefix, 300)
    for doc in ([1, 2, 3], [4, 5]):
        w.add_document(doc)
    w.finalize()
    with open(prefix + ".idx", "ab") as f:
        f.write(bytes([0, 0]))  # two sequences' modes
    assert [IndexedDataset(prefix).get(i).tolist() for i in range(2)] == [[1, 2, 3], [4, 5]]
    with open(prefix + ".idx", "ab") as f:
        f.write(bytes([0]))
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        IndexedDataset(prefix)


def test_partitions_write_documents_in_megatrons_order(tmp_path, capsys):
    """From a review against Megatron's tool: with --partitions P it deals the input lines round-robin into P files
    (line i of all the inputs, a blank one too, into partition i % P) and writes the partitions one after
    another; ours kept the input order, so --split and the shuffle saw other documents in other places.
    --keep-sequential-samples keeps the input order there (contiguous partitions), as here."""
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(4)) + "\n")  # (a blank 5th line)
    b.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(5, 8)))
    prefix = str(tmp_path / "o")

    def order(*extra):
        argv = ["--input", str(a), str(b), "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
        assert preprocess_data.main([*argv, *extra]) == 0
        ds = IndexedDataset(prefix + "_text_document")
        return [bytes(ds.get(i).tolist()).decode() for i in range(len(ds))]

    # lines 0..7 (line 4 blank): partition 0 takes 0, 2, 4, 6; partition 1 takes 1, 3, 5, 7
    assert order("--partitions", "2") == ["d0", "d2", "d6", "d1", "d3", "d5", "d7"]
    assert "documents in Megatron's order" in capsys.readouterr().out
    assert order("--partitions", "2", "--workers", "2") == ["d0", "d2", "d6", "d1", "d3", "d5", "d7"]
    assert order("--partitions", "2", "--keep-sequential-samples") == [f"d{i}" for i in (0, 1, 2, 3, 5, 6, 7)]
    assert order() == [f"d{i}" for i in (0, 1, 2, 3, 5, 6, 7)]


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--workers", "-1"], "error: --workers -1 must be >= 1 (tokenising processes)\n"),
        (["--output-prefix", "out/"], "error: --output-prefix out/ ends in a directory separator: give a file name "
         "prefix, e.g. out/corpus (the files are PREFIX_text_document.bin/.idx)\n"),
    ],
)  # fmt: skip
def test_preprocess_flags_a_failure_review_found_taken(tmp_path, extra, said):
    """From a failure review: --workers -1 was taken as one, and --output-prefix DIR/ wrote DIR/_text_document.*"""
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "ab"}) + "\n")
    argv = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
            str(tmp_path / "o"), "--tokenizer-type", "ByteLevelTokenizer", *extra]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr == said, out.stderr


def test_an_empty_input_is_warned_of(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("")
    argv = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
            str(tmp_path / "o"), "--tokenizer-type", "ByteLevelTokenizer"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True)
    assert out.returncode == 0 and f"warning: --input {src} held no documents" in out.stderr, out.stderr


def test_sigterm_removes_the_partial_output_and_a_killed_runs_leftovers_are_removed(tmp_path, capsys, monkeypatch):
    """An exploratory run's: SIGTERM (a scheduler's time limit) or SIGKILL midway left PREFIX.bin.HOST.PID.partial,
    as large as the output so far, and no later run removed it (each retry of a multi-TB corpus one more)."""
    import os
    import signal
    import socket

    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    from megatron_lite.data.indexed import IndexedDatasetWriter

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    prefix = str(tmp_path / "o")
    argv = ["--input", str(src), "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
    added = IndexedDatasetWriter.add_document

    def signalled(self, *a, **kw):  # (the signal arrives midway, once a document is written)
        added(self, *a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(IndexedDatasetWriter, "add_document", signalled)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        preprocess_data.main(argv)
    assert stopped.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    assert "stopped by SIGTERM: the partial output is removed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    monkeypatch.setattr(IndexedDatasetWriter, "add_document", added)

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    killed = tmp_path / f"o_text_document.bin.{host}.{int(gone.stdout)}.partial"  # (its writer's process is gone)
    running = tmp_path / f"o_text_document.bin.{host}.{os.getppid()}.partial"  # (a writer still running)
    elsewhere = tmp_path / f"o_text_document.bin.otherhost.{int(gone.stdout)}.partial"  # (not seen from here)
    # (a review's: a writer in another PID namespace, a container on the host's network, looks gone: its lock)
    held = tmp_path / f"o_text_document.idx.{host}.{int(gone.stdout)}.partial"
    fresh = tmp_path / f"o_text_document.idx.{host}.{int(gone.stdout) + 1}.partial"  # (written a moment ago)
    for path in (killed, running, elsewhere, held, fresh):
        path.write_bytes(b"x" * 100)
        if path is not fresh:
            os.utime(path, (1e9, 1e9))  # (untouched for years)
    from megatron_lite.checkpoint.atomic import hold_temp

    lock = hold_temp(str(held))
    assert lock is not None
    assert preprocess_data.main(argv) == 0
    assert f"removed {killed}, left by an earlier run that was killed" in capsys.readouterr().err
    assert not killed.exists() and running.exists() and elsewhere.exists() and held.exists() and fresh.exists()
    lock.close()
    ds = IndexedDataset(prefix + "_text_document")
    assert len(ds) == 50
    # (a review's: called from another thread, setting the SIGTERM handler raised and left the .partial files)
    import threading

    done = []
    runner = threading.Thread(target=lambda: done.append(preprocess_data.main([*argv[:3], prefix + "_t", *argv[4:]])))
    runner.start()
    runner.join(60)
    assert done == [0] and len(IndexedDataset(prefix + "_t_text_document")) == 50
