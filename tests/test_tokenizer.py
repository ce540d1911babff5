"""Tokenizer wrapper, streaming detokenization and stop strings, checked against Hugging Face's own decode.

The tokenizers are trained here on a few lines of text (no network): a byte-level BPE (GPT-2 / Llama 3
style), a SentencePiece-style BPE with the Metaspace pre-tokenizer and decoder, and a Llama 2 style one
with byte fallback.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jserve.tokenizer import (
    MAX_HELD_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    ChatTemplateError,
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    TokenizerLoadError,
    load_tokenizer,
    normalize_messages,
)

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. user assistant system A: Q:",
    "你好，世界！日本語のテキストです。中文字符和标点。",
    "Emoji: 🎉 🚀 😀 👍🏽 👨\u200d👩\u200d👧 café naïve über Ærøskøbing jalapeño",
    "  spaces\tand\ttabs\nand newlines\n\n  indented code: def f(x): return x + 1",
] * 10
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Characters the test texts are drawn from: ASCII, whitespace, accents (also combining), CJK, emoji parts.
CHARS = (list("abcXYZ019 .,!?:'\"\n\t") + list("éñüçÅ") + ["\u0301"] + list("你好世界日本語")
         + ["🎉", "🚀", "😀", "👍", "🏽", "\u200d", "🦀", "∑", "€", "𝔘"])
texts = st.text(alphabet=st.sampled_from(CHARS) | st.characters(exclude_categories=("Cs",),
                                                                exclude_characters="\ufffd"), max_size=24)
SP_SPECIALS = ["<unk>", "<s>", "</s>"]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


def _metaspace_bpe() -> PreTrainedTokenizerFast:
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SP_SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """Llama 2 style: characters outside the vocabulary become <0xNN> byte tokens."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = RawTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SP_SPECIALS))
    # The trainer cannot add byte tokens as ordinary (non-special) tokens, so rebuild the model with them.
    learned = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    names = SP_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    names += [name for name, _ in learned if name not in names]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    vocab = {name: i for i, name in enumerate(names)}
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    raw.add_special_tokens(SP_SPECIALS)
    raw.normalizer = normalizer
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {"byte_level": Tokenizer(_byte_level_bpe()), "metaspace": Tokenizer(_metaspace_bpe()),
            "byte_fallback": Tokenizer(_byte_fallback_bpe())}


KINDS = ["byte_level", "metaspace", "byte_fallback"]
# SentencePiece-style decoders drop the leading space of a sequence's first token; in a stream it is kept.
KEEPS_STRIPPED_SPACE = {"byte_level": False, "metaspace": True, "byte_fallback": True}


def hf_decode(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    return tok.hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool = True) -> list[str]:
    """Every delta, finish() last; checks the result against Hugging Face's decode of the whole sequence."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in out] + [detok.finish()]
    streamed = "".join(deltas)
    assert streamed == detok.text and detok.token_ids == out
    head, whole = hf_decode(tok, prompt, skip), hf_decode(tok, prompt + out, skip)
    assert whole.startswith(head)
    assert streamed == whole[len(head):]  # what the output adds to the decoded prompt
    return deltas


def assert_matches_decode(kind: str, tok: Tokenizer, prompt: list[int], out: list[int], streamed: str,
                          skip: bool = True) -> None:
    full = hf_decode(tok, out, skip)
    if KEEPS_STRIPPED_SPACE[kind] and prompt and streamed == " " + full:
        return
    assert streamed == full


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
@PROPERTY
@given(prompt_text=texts, text=texts)
def test_streamed_text_equals_hf_decode(toks, kind: str, skip: bool, prompt_text: str, text: str) -> None:
    tok = toks[kind]
    prompt = tok.encode(prompt_text + " A:")
    out = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, prompt, out, skip)
    assert_matches_decode(kind, tok, prompt, out, "".join(deltas), skip)
    # Valid text never shows a replacement character: incomplete characters wait for their last byte.
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
@PROPERTY
@given(prompt_text=texts, data=st.data())
def test_streamed_random_ids_equal_hf_decode(toks, kind: str, skip: bool, prompt_text: str, data) -> None:
    tok = toks[kind]
    # The prompt ends in plain ASCII: a byte-fallback run crossing into random output bytes would change
    # Hugging Face's own decode of the prompt, leaving no well-defined text for the output.
    prompt = tok.encode(prompt_text + " A:")
    out = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    deltas = stream(tok, prompt, out, skip)
    assert_matches_decode(kind, tok, prompt, out, "".join(deltas), skip)


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_decode_is_hf_decode(toks, kind: str, data) -> None:
    """Tokenizer.decode calls the Rust decoder directly for a plain fast tokenizer: the same text as hf.decode."""
    tok = toks[kind]
    assert tok._rust_decode is not None
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_decode(tok, ids, skip)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_token_is_hf_decode_of_the_token(toks, kind: str) -> None:
    """Every token of the vocabulary, twice (the second answer is the remembered one), both ways of skipping."""
    tok = toks[kind]
    for _ in range(2):
        for skip in (True, False):
            assert [tok.decode_token(i, skip) for i in range(tok.vocab_size)] == \
                [hf_decode(tok, [i], skip) for i in range(tok.vocab_size)]


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(text=texts)
def test_stream_without_prompt_is_plain_decode(toks, kind: str, text: str) -> None:
    tok = toks[kind]
    out = tok.encode(text)
    assert "".join(stream(tok, [], out)) == hf_decode(tok, out, True)


@pytest.mark.parametrize("kind", ["metaspace", "byte_fallback"])
def test_first_token_gets_its_leading_space_after_the_prompt(toks, kind: str) -> None:
    tok = toks[kind]
    prompt, out = tok.encode("Hello"), tok.encode("world", add_special_tokens=False)
    assert hf_decode(tok, out, True) == "world"  # decoded alone, the space is gone
    assert "".join(stream(tok, prompt, out)) == " world"
    # Skipped special tokens at the end of the prompt decode to nothing: the context reaches past them.
    prompt += [tok.eos_token_id] * (PROMPT_CONTEXT_TOKENS + 2)
    assert "".join(stream(tok, prompt, out)) == " world"


def test_emoji_split_over_byte_tokens_is_emitted_whole(toks) -> None:
    tok = toks["byte_level"]
    out = tok.encode("🦀", add_special_tokens=False)
    assert len(out) > 1  # precondition: the crab is not in the tiny vocabulary
    assert stream(tok, tok.encode("Hi"), out) == [""] * (len(out) - 1) + ["🦀", ""]


def test_byte_fallback_run_waits_for_its_end(toks) -> None:
    tok = toks["byte_fallback"]
    out = tok.encode("∑ ok", add_special_tokens=False)
    assert len(tok.byte_token_ids) == 256 and sum(t in tok.byte_token_ids for t in out) == 3
    deltas = stream(tok, tok.encode("A:"), out)
    run = [i for i, t in enumerate(out) if t in tok.byte_token_ids]
    assert [deltas[i] for i in run] == ["", "", ""] and deltas[run[-1] + 1].startswith("∑")
    assert "".join(deltas) == " ∑ ok"


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(text=texts)
def test_token_bytes_join_to_the_text(toks, kind: str, text: str) -> None:
    """An output's token bytes, joined, are the UTF-8 of the text the stream emits for it (Hugging Face's decode
    in context), though single tokens of an emoji or a CJK character are not valid UTF-8 on their own."""
    tok = toks[kind]
    out = tok.encode(text, add_special_tokens=False)
    joined = b"".join(tok.token_bytes(i) for i in out)
    assert joined == "".join(stream(tok, tok.encode("A:"), out, skip=False)).encode()
    if kind == "byte_level":
        assert joined == text.encode()


def _hf_byte_level_bytes(hf, token_ids: list[int]) -> list[bytes]:
    """The tokens' bytes by transformers' own GPT-2 byte alphabet (its slow-tokenizer conversion's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    return [bytes(byte_decoder[char] for char in token) for token in hf.convert_ids_to_tokens(token_ids)]


def _real_tokenizers() -> list:
    from checkpoints import DEMO_MODEL_DIR, default_model

    return [DEMO_MODEL_DIR] + ([default_model()] if default_model() is not None else [])  # + SmolLM2's GGUF


@pytest.mark.parametrize("path", _real_tokenizers(), ids=lambda p: p.name)
def test_token_bytes_of_real_byte_level_tokenizers(path) -> None:
    tok = load_tokenizer(path)
    assert tok.token_spelling == "byte_level"
    for text in ["🌟🌟", "你好，世界", "naïve café 👨\u200d👩\u200d👧", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert any(not _is_utf8(tok.token_bytes(i)) for i in ids) or "<" in text  # partial characters occur
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    added = tok.added_token_ids
    ordinary = [i for i in range(tok.vocab_size) if i not in added]
    assert [tok.token_bytes(i) for i in ordinary] == _hf_byte_level_bytes(tok.hf, ordinary)
    assert all(tok.token_bytes(i) == tok.hf.convert_ids_to_tokens(i).encode() for i in added)


def test_token_bytes_of_sentencepiece_bytes_and_spaces(toks) -> None:
    tok = toks["byte_fallback"]
    assert tok.token_spelling == "sentencepiece"
    out = tok.encode("∑ ok", add_special_tokens=False)
    assert [tok.token_bytes(i) for i in out if i in tok.byte_token_ids] == [bytes([b]) for b in "∑".encode()]
    assert b"".join(tok.token_bytes(i) for i in out) == " ∑ ok".encode()  # the ▁ of each word is its space


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_special_tokens_kept_or_skipped(toks) -> None:
    tok = toks["byte_level"]
    out = tok.encode("Hi") + [tok.eos_token_id] + tok.encode(" there")
    assert "".join(stream(tok, tok.encode("A:"), out, skip=True)) == "Hi there"
    assert "".join(stream(tok, tok.encode("A:"), out, skip=False)) == "Hi<|endoftext|> there"


class _CountingTokenizer(Tokenizer):
    """Records how many ids each decode call gets, to check the per-token cost."""

    def __init__(self, hf):
        super().__init__(hf)
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        self.lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_add_decodes_a_small_window(toks) -> None:
    tok = _CountingTokenizer(toks["byte_level"].hf)
    text = "The quick brown fox 🦀 jumps 你好 over the lazy dog. " * 30
    out = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Q: tell me A:"))
    tok.lengths.clear()
    emitted = "".join(detok.add(t) for t in out)
    assert len(out) > 300 and max(tok.lengths) <= PROMPT_CONTEXT_TOKENS + 8
    assert emitted + detok.finish() == text


def test_malformed_bytes_are_held_a_bounded_number_of_tokens(toks) -> None:
    tok = _CountingTokenizer(toks["byte_level"].hf)
    lead_byte = tok.encode("🦀", add_special_tokens=False)[0]  # a lone 0xF0 never completes a character
    out = [lead_byte] * (3 * MAX_HELD_TOKENS)
    detok = IncrementalDetokenizer(tok, tok.encode("A:"))
    emitted = "".join(detok.add(t) for t in out)
    assert max(tok.lengths) <= 2 * MAX_HELD_TOKENS + PROMPT_CONTEXT_TOKENS
    assert emitted and emitted + detok.finish() == hf_decode(tok, out, True)


def test_finish_is_final(toks) -> None:
    tok = toks["byte_level"]
    detok = IncrementalDetokenizer(tok.hf, tok.encode("A:"))  # a bare Hugging Face tokenizer works too
    assert detok.add(tok.encode("x")[0]) == "x"
    assert detok.finish() == "" and detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add(0)


# ---- stop strings ----


def run_matcher(stops: list[str], deltas: list[str], include: bool = False) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops, include_stop_str=include)
    out = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        out.append(text)
        if matched is not None:
            return out, matched
    return out + [matcher.flush()], None


def test_stop_string_spanning_deltas_is_excluded() -> None:
    assert run_matcher(["STOP"], ["abc ST", "O", "P tail"]) == (["abc ", "", ""], "STOP")


def test_partial_stop_is_held_then_released() -> None:
    assert run_matcher(["STOP"], ["x S", "ay ST", "ill"]) == (["x ", "Say ", "STill", ""], None)


def test_held_text_is_flushed_at_the_end() -> None:
    assert run_matcher(["</end>"], ["done </e"]) == (["done ", "</e"], None)


def test_include_stop_str_and_later_feeds() -> None:
    matcher = StopStringMatcher(["##"], include_stop_str=True)
    assert matcher.feed("a#") == ("a", None)
    assert matcher.feed("#b") == ("##", "##")
    assert matcher.feed("more") == ("", "##") and matcher.flush() == ""


def test_longest_possible_start_is_held() -> None:
    assert run_matcher(["aab"], ["xaa", "b"]) == (["x", ""], "aab")
    assert run_matcher(["aab"], ["xaa", "ab"]) == (["x", "a"], "aab")


def test_first_completed_stop_wins() -> None:
    assert run_matcher(["abcd", "bc"], ["abcd"]) == (["a"], "bc")
    assert run_matcher(["bc", "abc"], ["xabc"]) == (["x"], "abc")  # same end: the longer one


def test_no_stops_passes_text_through() -> None:
    assert run_matcher([], ["a", "b"]) == (["a", "b", ""], None)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text before the first stop string to complete, by brute force over every end position."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[:end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab", max_size=20), stops=st.lists(st.text("ab", min_size=1, max_size=4), max_size=3),
       data=st.data())
def test_stop_matcher_equals_brute_force_for_any_split(text: str, stops: list[str], data) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, matched = run_matcher(stops, deltas)
    assert ("".join(out), matched) == reference_cut(text, stops)


# ---- chat templates, messages, loading ----


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 你好 🎉"}]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_hf(toks, generation_prompt: bool) -> None:
    tok = toks["byte_level"]
    expected = tok.hf.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt, tokenize=True,
                                          return_dict=False)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt) == list(expected)
    text = tok.render_chat(MESSAGES, add_generation_prompt=generation_prompt)
    assert text == tok.hf.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt,
                                              tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") == generation_prompt


def test_text_parts_are_joined(toks) -> None:
    tok = toks["byte_level"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert tok.render_chat(parts) == tok.render_chat([{"role": "user", "content": "one\ntwo"}])


def test_missing_chat_template_is_a_clear_error(toks) -> None:
    with pytest.raises(ChatTemplateError, match="has no chat template") as err:
        toks["metaspace"].apply_chat_template(MESSAGES)
    assert isinstance(err.value, ValueError)
    with pytest.raises(ChatTemplateError):
        toks["metaspace"].render_chat(MESSAGES)


@pytest.mark.parametrize("messages", [
    "hello",
    [],
    ["hello"],
    [{"content": "no role"}],
    [{"role": 3, "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": ["plain string part"]}],
])
def test_bad_messages_are_rejected(toks, messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        toks["byte_level"].apply_chat_template(messages)


def test_messages_are_normalized_copies() -> None:
    """Text parts joined; an assistant turn that only calls tools gets empty content (templates that know no tools
    still render it) and its calls' JSON arguments as objects (what tool-aware templates render)."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalize_messages([parts, tool_turn]) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "",
         "tool_calls": [{**call, "function": {"name": "f", "arguments": {"x": 1}}}]}]
    assert isinstance(parts["content"], list) and tool_turn["content"] is None  # the caller's messages are left alone
    assert call["function"]["arguments"] == '{"x": 1}'


def test_load_tokenizer_round_trip(toks, tmp_path) -> None:
    toks["byte_level"].hf.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.vocab_size == len(toks["byte_level"].hf)
    assert tok.eos_token_id == toks["byte_level"].eos_token_id is not None
    assert tok.decode(tok.encode("Hi 你好 🎉")) == "Hi 你好 🎉"
    assert tok.apply_chat_template(MESSAGES) == toks["byte_level"].apply_chat_template(MESSAGES)


@pytest.mark.parametrize("setup", ["missing", "empty", "config_only"])
def test_no_tokenizer_is_a_clear_error(tmp_path, setup: str) -> None:
    path = tmp_path / "model"
    if setup != "missing":
        path.mkdir()
    if setup == "config_only":  # transformers would build an empty tokenizer from this alone
        (path / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    with pytest.raises(TokenizerLoadError, match="no tokenizer at") as err:
        load_tokenizer(str(path))
    assert isinstance(err.value, ValueError) and str(path) in str(err.value)


@pytest.mark.parametrize(("kind", "declared_class", "model_type"), [
    ("byte_level", None, "llama"),  # the class save_pretrained writes
    ("byte_level", "LlamaTokenizerFast", "llama"),  # Llama 3: a Llama class over a byte-level tokenizer.json
    ("metaspace", "LlamaTokenizerFast", "llama"),
    ("byte_level", "Qwen2TokenizerFast", "qwen2"),
    ("byte_fallback", "GemmaTokenizerFast", "gemma"),
])
def test_load_tokenizer_picks_what_auto_tokenizer_picks(toks, tmp_path, kind: str, declared_class, model_type) -> None:
    # load_tokenizer hands AutoTokenizer a config holding only the model type (loading the model's own config
    # class costs seconds); the tokenizer must come out the same as when AutoTokenizer loads the config itself.
    from transformers import AutoTokenizer, LlamaConfig

    toks[kind].hf.save_pretrained(tmp_path)
    LlamaConfig(vocab_size=len(toks[kind].hf)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    if declared_class is not None:
        tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        tokenizer_config["tokenizer_class"] = declared_class
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    ours = load_tokenizer(str(tmp_path)).hf
    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert type(ours) is type(reference)
    text = "Hello world! 你好 🎉 <|im_start|> café\\n  indented"
    assert ours.encode(text) == reference.encode(text)
    assert ours.all_special_tokens == reference.all_special_tokens
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == reference.decode(reference.encode(text),
                                                                                       skip_special_tokens=True)
