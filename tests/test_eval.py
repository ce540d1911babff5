"""`jserve eval perplexity`: llama-perplexity's windows (worked by hand), perplexity through the engine's prompt
logprobs equal to transformers' log_softmax over the same windows on both executors, and the command end to end.

The executors: attention_backend "auto" (on CPU the CPU layer executor) and "reference" (the XLA executor)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hf_models import load_hf

from jserve.cli import main
from jserve.eval import DEFAULT_TEXT
from jserve.eval.perplexity import (
    Window,
    evaluate,
    llama_perplexity_windows,
    perplexity_of,
    read_text,
    score_windows,
    tokenize_text,
    tokenizer_bos_id,
)
from jserve.tokenizer import load_tokenizer

ENGINE_FLAGS = ["--no-warmup", "--compilation-cache-dir", "", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "128", "--max-num-seqs", "16"]
BOS = 1  # the tiny tokenizer's <s>


@pytest.fixture(scope="module", params=["auto", "reference"], ids=["cpu-kernels", "xla"])
def executor(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def text() -> str:
    """The start of the shipped text: ~1,000 tokens of the tiny tokenizer, 15 windows of 64."""
    return read_text(DEFAULT_TEXT)[:1800]


def scored(windows: list[Window]) -> list[int]:
    """The text positions the windows score."""
    return [w.start + p for w in windows for p in range(w.first_scored, len(w.tokens))]


def test_default_scheme_by_hand():
    """llama-perplexity -c 8 over 21 tokens (BOS, then 101..120): 21 // 8 = 2 chunks, tokens 16..20 unread; each chunk
    starts with BOS (the second's own first token, 108, replaced) and scores positions 8/2 + 1 .. 7 (3 tokens)."""
    tokens = [BOS, *range(101, 121)]
    windows = llama_perplexity_windows(tokens, 8, bos_id=BOS)
    assert windows == [Window(0, [BOS, *range(101, 108)], 5), Window(8, [BOS, *range(109, 116)], 5)]
    assert [w.tokens[w.first_scored:] for w in windows] == [[105, 106, 107], [113, 114, 115]]
    assert scored(windows) == [5, 6, 7, 13, 14, 15]
    # no BOS: the chunks as they are
    plain = list(range(100, 121))
    assert llama_perplexity_windows(plain, 8) == [Window(0, list(range(100, 108)), 5),
                                                  Window(8, list(range(108, 116)), 5)]
    # an odd context: first = 7 // 2 = 3, positions 4..6 scored (7 - 3 - 1 = 3 tokens); --chunks 2 of 3
    windows = llama_perplexity_windows(plain, 7, max_chunks=2)
    assert [(w.start, w.tokens, w.first_scored) for w in windows] == [(0, plain[:7], 4), (7, plain[7:14], 4)]
    with pytest.raises(ValueError, match="at least 16"):
        llama_perplexity_windows(plain[:15], 8)


def test_strided_scheme_by_hand():
    """llama-perplexity -c 8 --ppl-stride 3 over 20 tokens: (20 - 8 + 2) // 3 = 4 windows at 0, 3, 6, 9, each scoring
    its last 3 tokens: text positions 5..16 once each. The text's tokens as they are (no BOS written in)."""
    tokens = [BOS, *range(101, 120)]
    windows = llama_perplexity_windows(tokens, 8, stride=3, bos_id=BOS)
    assert [(w.start, w.first_scored) for w in windows] == [(0, 5), (3, 5), (6, 5), (9, 5)]
    assert all(w.tokens == tokens[w.start:w.start + 8] for w in windows)
    assert scored(windows) == list(range(5, 17))
    assert len(llama_perplexity_windows(tokens, 8, stride=3, max_chunks=2)) == 2
    for stride in (8, 9):
        with pytest.raises(ValueError, match="--stride"):
            llama_perplexity_windows(tokens, 8, stride=stride)


def test_a_bad_stride_or_text_is_refused_before_the_model_loads(tmp_path, capsys):
    """The window check and the text need no model: a stride of --context, or a text that is not UTF-8 (named), is
    refused before a (possibly large) model loads."""
    assert main(["eval", "perplexity", "--model", str(tmp_path / "no-such-model"), "--context", "64",
                 "--stride", "64", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "--stride must be 0 (llama-perplexity's default scheme) or in [1, --context - 1] = [1, 63]" in err
    assert "no-such-model" not in err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert main(["eval", "perplexity", "--model", str(tmp_path / "no-such-model"), "--text",
                 str(tmp_path / "latin1.txt")]) == 2
    assert f"--text {tmp_path / 'latin1.txt'}: not UTF-8 text" in capsys.readouterr().err


def test_tokenization_puts_bos_first_where_the_tokenizer_does(tiny_tokenizer_dir, tmp_path):
    from tokenizers import processors

    tok = load_tokenizer(tiny_tokenizer_dir)
    plain = tok.encode("the quick brown fox", add_special_tokens=False)
    assert tokenizer_bos_id(tok) is None
    assert tokenize_text(tok, "the quick brown fox") == (plain, None)
    assert tokenize_text(tok, "the quick brown fox", add_bos=True) == ([BOS, *plain], BOS)

    tok.hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.hf.save_pretrained(tmp_path)
    with_bos = load_tokenizer(tmp_path)
    assert tokenizer_bos_id(with_bos) == BOS
    assert tokenize_text(with_bos, "the quick brown fox") == ([BOS, *plain], BOS)
    assert tokenize_text(with_bos, "the quick brown fox", add_bos=False) == (plain, None)


def test_perplexity_of_matches_llama_cpp_formula():
    nll = np.array([1.0, 2.0, 4.0])
    ppl, error = perplexity_of(nll)
    mean = 7 / 3
    assert ppl == pytest.approx(math.exp(mean))
    assert error == pytest.approx(math.exp(mean) * math.sqrt((21 / 3 - mean * mean) / 2))
    assert perplexity_of(np.array([2.0])) == (pytest.approx(math.exp(2.0)), None)


def hf_nll(model, windows: list[Window]) -> np.ndarray:
    """transformers' negative log-likelihood of each scored token (float32 log_softmax over each whole window)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([w.tokens for w in windows])).logits.float(), -1).numpy()
    return np.asarray([-logprobs[i, p - 1, w.tokens[p]] for i, w in enumerate(windows)
                       for p in range(w.first_scored, len(w.tokens))], dtype=np.float64)


@pytest.mark.parametrize("stride, add_bos", [(0, True), (24, None)], ids=["default-bos", "strided"])
def test_perplexity_matches_transformers(hf_model_dir, llm_factory, executor, text, stride, add_bos):
    model_dir = hf_model_dir("llama")
    llm = llm_factory(model_dir, attention_backend=executor)
    tokens, bos = tokenize_text(llm.get_tokenizer(), text, add_bos)
    windows = llama_perplexity_windows(tokens, 64, stride, bos)
    assert len(windows) >= 10 and (bos == BOS) == (add_bos is True)
    expected = hf_nll(load_hf(model_dir), windows)
    np.testing.assert_allclose(score_windows(llm, windows), expected, rtol=1e-4, atol=1e-5)
    result = evaluate(llm, text, 64, stride, add_bos)
    assert result["num_scored_tokens"] == len(expected) == len(scored(windows))
    assert result["num_windows"] == len(windows) and result["num_processed_tokens"] == 64 * len(windows)
    ppl, error = perplexity_of(expected)
    assert result["perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert result["perplexity_error"] == pytest.approx(error, rel=1e-3)


def test_cli_writes_the_json(hf_model_dir, llm_factory, text, tmp_path, capsys):
    model_dir = hf_model_dir("llama")
    text_file = tmp_path / "text.txt"
    text_file.write_text(text + "\n")  # the trailing newline is dropped, as llama-perplexity's -f drops it
    out = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", "--model", str(model_dir), "--text", str(text_file), "--context", "64",
                 "--output-json", str(out), "--disable-tqdm", *ENGINE_FLAGS]) == 0
    report = json.loads(out.read_text())
    expected = evaluate(llm_factory(model_dir), text, 64)
    assert report["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)
    for key in ("num_text_tokens", "num_windows", "num_scored_tokens", "num_processed_tokens"):
        assert report[key] == expected[key]
    assert report["num_scored_tokens"] == report["num_windows"] * 31 and report["scheme"] == "default"
    assert report["context"] == 64 and report["stride"] == 0 and report["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert f"Final estimate: PPL = {report['perplexity']:.4f} +/- " in printed
    assert f"Scored {report['num_scored_tokens']} of the text's {report['num_text_tokens']} tokens" in printed


def test_a_window_as_long_as_the_models_context(hf_model_dir, text, tmp_path):
    """--context equal to max_position_embeddings (llama-perplexity -c n_ctx_train) scores: a window of C tokens
    needs C positions, not C + 1 (each request's one generated token is the window's last, forced), and every
    window's last token scores as transformers scores it."""
    model_dir = hf_model_dir("llama", max_position_embeddings=64)
    (tmp_path / "text.txt").write_text(text)
    out = tmp_path / "ppl.json"
    flags = [flag for i, flag in enumerate(ENGINE_FLAGS) if "--max-model-len" not in ENGINE_FLAGS[max(0, i - 1):i + 1]]
    assert main(["eval", "perplexity", "--model", str(model_dir), "--text", str(tmp_path / "text.txt"),
                 "--context", "64", "--stride", "16", "--chunks", "3", "--output-json", str(out), "--disable-tqdm",
                 *flags]) == 0
    report = json.loads(out.read_text())
    tokens, bos = tokenize_text(load_tokenizer(model_dir), text)
    expected = hf_nll(load_hf(model_dir), llama_perplexity_windows(tokens, 64, 16, bos, 3))
    assert report["num_scored_tokens"] == len(expected) == 48
    assert report["mean_nll"] == pytest.approx(float(np.mean(expected)), rel=1e-5)


def test_the_default_text_ships():
    from jserve.cli import build_parser

    args = build_parser().parse_args(["eval", "perplexity"])
    assert args.text == str(DEFAULT_TEXT) and args.context == 512 and args.stride == 0
    text = read_text(DEFAULT_TEXT)
    assert 20_000 < len(text.encode("utf-8")) < 40_000 and text.isascii()
