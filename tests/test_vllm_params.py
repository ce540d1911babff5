"""The offline request API against vLLM's: SamplingParams' fields and helpers, RequestOutput / CompletionOutput.

Each test checks against something outside jserve: transformers' tokenizer.decode, or vLLM's rule as its source
(vllm/sampling_params.py, vllm/outputs.py, vllm/v1/engine/detokenizer.py) states it, quoted in the docstring."""

from __future__ import annotations

import pytest

from jserve.outputs import CompletionOutput, RequestOutput
from jserve.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams
from jserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def llm(hf_model_dir, llm_factory):
    return llm_factory(hf_model_dir("llama"))


def _vllm_text(hf, prompt: list[int], output: list[int], skip_special_tokens: bool,
               spaces_between_special_tokens: bool) -> str:
    """vLLM's FastIncrementalDetokenizer, with transformers' decode for its DecodeStream step: each generated token
    adds decode(prompt + output[:i+1]) minus decode(prompt + output[:i]), except that

        self.spaces_between_special_tokens = skip_special_tokens or spaces_between_special_tokens
        ...
        if is_special and self.last_special:
            # Return raw token string without any prefixed spaces.
            token = special_token

    where is_special means an added token (get_added_tokens_decoder()) and last_special starts False at the first
    generated token."""
    added = {i: t.content for i, t in hf.added_tokens_decoder.items()}
    bare = not (skip_special_tokens or spaces_between_special_tokens)
    text, last_special = "", False
    for i, token in enumerate(output):
        before = hf.decode(prompt + output[:i], skip_special_tokens=skip_special_tokens,
                           clean_up_tokenization_spaces=False)
        after = hf.decode(prompt + output[:i + 1], skip_special_tokens=skip_special_tokens,
                          clean_up_tokenization_spaces=False)
        step = after[len(before):]
        if bare:
            if token in added and last_special:
                step = added[token]
            last_special = token in added
        text += step
    return text


def _detokenize(tokenizer: Tokenizer, prompt: list[int], output: list[int], **kwargs) -> tuple[str, str]:
    """(the streamed text, the text decoded once at the end)."""
    streamed = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    text = "".join(streamed.add(t) for t in output) + streamed.finish()
    once = IncrementalDetokenizer(tokenizer, prompt, streaming=False, **kwargs)
    for t in output:
        once.add(t)
    return text, once.finish()


@pytest.fixture(scope="module")
def wordpiece():
    """A tokenizer whose decoder puts a space between tokens (WordPiece), the kind where the setting shows."""
    import transformers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3, "hello": 4, "world": 5, "##s": 6}
    rust = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=rust, cls_token="[CLS]", sep_token="[SEP]",
                                                pad_token="[PAD]", unk_token="[UNK]")


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_spaces_between_special_tokens_follows_vllms_rule(wordpiece, spaces, skip):
    """With skip_special_tokens=False and spaces_between_special_tokens=False, a generated added token right after
    another is its bare content (no space before it); anything else is the decoder's text (see _vllm_text)."""
    prompt, output = [4, 5], [1, 2, 5, 6, 2, 2, 1, 4, 0]
    expected = _vllm_text(wordpiece, prompt, output, skip, spaces)
    assert _detokenize(Tokenizer(wordpiece), prompt, output, skip_special_tokens=skip,
                       spaces_between_special_tokens=spaces) == (expected, expected)
    if not skip and not spaces:
        assert expected == " [CLS][SEP] worlds [SEP][SEP][CLS] hello [PAD]"


def test_spaces_between_special_tokens_on_both_tokenizer_kinds(hf_model_dir, tmp_path):
    """jserve's tokenizers (a Hugging Face directory's and a GGUF file's) follow vLLM's rule too; their byte-level
    decoder puts no space between tokens, so vLLM's text is the same either way."""
    from transformers import AutoTokenizer

    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    model_dir = hf_model_dir("llama")
    reference = AutoTokenizer.from_pretrained(model_dir)
    gguf_path = write_gguf(model_dir, tmp_path / "tiny.gguf")
    prompt = reference.encode("def f(x):")
    output = [1, 2, 0, *reference.encode(" return x", add_special_tokens=False), 2, 2]
    for tokenizer in (load_tokenizer(model_dir), load_tokenizer(gguf_path)):
        for spaces in (True, False):
            expected = _vllm_text(reference, prompt, output, False, spaces)
            assert _detokenize(tokenizer, prompt, output, skip_special_tokens=False,
                               spaces_between_special_tokens=spaces) == (expected, expected)
        assert expected == reference.decode(output, skip_special_tokens=False)


def test_spaces_between_special_tokens_in_generate(llm):
    """Through LLM.generate: special tokens kept, the text is vLLM's (see _vllm_text) for both settings."""
    hf = llm.get_tokenizer().hf
    prompt = hf.encode("def f(x):")
    allowed = [0, 1, 2, *hf.encode(" return x", add_special_tokens=False)]
    for spaces in (True, False):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, allowed_token_ids=allowed,
                                skip_special_tokens=False, spaces_between_special_tokens=spaces)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert out.text == _vllm_text(hf, prompt, list(out.token_ids), False, spaces)
    with pytest.raises(InvalidParameterError, match="spaces_between_special_tokens") as e:
        SamplingParams(spaces_between_special_tokens="no")
    assert e.value.param == "spaces_between_special_tokens"


def test_detokenize_false_gives_token_ids_only(llm):
    """vLLM: `detokenize: bool = True  # Whether to detokenize the output.` With False the text is "" and the token
    ids are those of a detokenized run; "stop strings are only supported when detokenize is True"."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with_text, without = llm.generate(["def f(x):", "def f(x):"], [params, params.clone(detokenize=False)],
                                      use_tqdm=False)
    assert with_text.outputs[0].text
    assert without.outputs[0].text == ""
    assert without.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert without.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidParameterError, match="detokenize") as e:
        SamplingParams(detokenize=False, stop=["\n"])
    assert e.value.param == "stop"
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(detokenize=None)
    assert e.value.param == "detokenize"


def test_skip_special_tokens(llm):
    """vLLM: `skip_special_tokens: bool = True  # Whether to skip special tokens in the output.` The text is
    transformers' decode of the output with the same flag (byte-level BPE: the ids' text, prompt aside)."""
    hf = llm.get_tokenizer().hf
    allowed = [0, 1, *hf.encode(" return x", add_special_tokens=False)]
    for skip in (True, False):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, allowed_token_ids=allowed,
                                skip_special_tokens=skip, seed=3)
        out = llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0]
        assert out.text == hf.decode(out.token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_output_kind():
    """vLLM's RequestOutputKind names CUMULATIVE (the default) and FINAL_ONLY; anything else is refused by name."""
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(output_kind="final_only")
    assert e.value.param == "output_kind"


def test_extra_args():
    """vLLM: `extra_args: dict[str, Any] | None = None  # Arbitrary additional args, that can be used by custom
    sampling implementations, plugins, etc. Not used by any in-tree sampling implementations.`"""
    params = SamplingParams(extra_args={"plugin": {"k": [1]}})
    assert params.extra_args == {"plugin": {"k": [1]}}
    assert SamplingParams().extra_args is None
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(extra_args=["x"])
    assert e.value.param == "extra_args"


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_whole_vocabulary_logprobs_are_refused_as_vllm_refuses_them(name):
    """vLLM: "When set to -1, return all `vocab_size` log probabilities", checked in _validate_logprobs:

        if num_logprobs == -1: num_logprobs = model_config.get_vocab_size()
        if num_logprobs > max_logprobs: raise VLLMValidationError(..., parameter="logprobs")

    with max_logprobs 20 by default: -1 is refused for any vocabulary over 20 tokens. jserve refuses it too (its
    sampler returns at most 20), naming the field. vLLM reads True as 1."""
    with pytest.raises(InvalidParameterError, match="whole vocabulary") as e:
        SamplingParams(**{name: -1})
    assert e.value.param == name
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**{name: 21})
    assert e.value.param == name
    assert getattr(SamplingParams(**{name: True}), name) == 1


def test_from_optional():
    """vLLM's SamplingParams.from_optional: None for n, presence_penalty, frequency_penalty, repetition_penalty,
    temperature or top_p means the default (`n=1 if n is None else n`, ...)."""
    params = SamplingParams.from_optional(n=None, presence_penalty=None, frequency_penalty=None,
                                          repetition_penalty=None, temperature=None, top_p=None, max_tokens=5,
                                          stop="x")
    assert (params.n, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.temperature, params.top_p) == (1, 0.0, 0.0, 1.0, 1.0, 1.0)
    assert params.max_tokens == 5 and params.stop == ["x"]
    assert SamplingParams.from_optional(temperature=0.5).temperature == 0.5
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams.from_optional(top_p=0)
    assert e.value.param == "top_p"


def test_clone_shares_nothing_mutable():
    """vLLM's clone() is copy.deepcopy(self): changing the copy leaves the original alone."""
    params = SamplingParams(stop=["a"], stop_token_ids=[5], logit_bias={3: 1.0}, bad_words=["x"],
                            allowed_token_ids=[1, 2], extra_args={"k": [1]})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("b")
    copy.stop_token_ids.append(6)
    copy.logit_bias[4] = 2.0
    copy.bad_words.append("y")
    copy.allowed_token_ids.append(3)
    copy.extra_args["k"].append(2)
    assert params == SamplingParams(stop=["a"], stop_token_ids=[5], logit_bias={3: 1.0}, bad_words=["x"],
                                    allowed_token_ids=[1, 2], extra_args={"k": [1]})


def test_vllm_conveniences_in_post_init():
    """vLLM's __post_init__: `if self.seed == -1: self.seed = None`, and stop_token_ids = list(dict.fromkeys(...))."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(stop_token_ids=[7, 3, 7]).stop_token_ids == [7, 3]
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(stop_token_ids=[[1]])
    assert e.value.param == "stop_token_ids"


def test_sampling_params_repr_is_vllms():
    """vLLM's SamplingParams.__repr__ (its fields in its order, less thinking_token_budget, which jserve lacks)."""
    params = SamplingParams(temperature=0.5, stop="x", max_tokens=7, logprobs=2)
    assert repr(params) == (
        "SamplingParams(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=0.5, "
        "top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=['x'], stop_token_ids=[], bad_words=[], "
        "include_stop_str_in_output=False, ignore_eos=False, max_tokens=7, min_tokens=0, logprobs=2, "
        "prompt_logprobs=None, skip_special_tokens=True, spaces_between_special_tokens=True, "
        "structured_outputs=None, extra_args=None)")
    assert repr(SamplingParams(cache_salt="s")).endswith("extra_args=None, cache_salt='s')")


def test_request_output_fields(llm):
    """vLLM's RequestOutput / CompletionOutput, as a user reads them: outputs[i].index is the sample's index;
    finished (a bool) on the request, finished() (a method) on a completion; stop_reason "The stop string or token
    id that caused the completion to stop, None if the completion finished for some other reason including
    encountering the EOS token"; cumulative_logprob the sum of the sampled tokens' logprobs (v1: None unless
    logprobs were asked for); prompt_logprobs None for the first prompt token; num_cached_tokens "The number of
    tokens with prefix cache hit"."""
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=1, logprobs=2, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.finished is True
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert c.finished() is True
        assert len(c.logprobs) == len(c.token_ids)
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids,
                                                                                strict=True)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert isinstance(out.num_cached_tokens, int) and isinstance(out.metrics, dict)

    plain = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    by_token = llm.generate([prompt], greedy.clone(stop_token_ids=[ids[2]]), use_tqdm=False)[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", ids[2])
    length = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert (length.finish_reason, length.stop_reason) == ("length", None)


def test_output_reprs_are_vllms():
    """vLLM's CompletionOutput.__repr__ and RequestOutput.__repr__ (less the fields jserve lacks: routed_experts,
    kv_transfer_params, encoder_prompt*)."""
    completion = CompletionOutput(index=0, text="hi", token_ids=[5], finish_reason="stop", stop_reason=2,
                                  cumulative_logprob=-1.5, logprobs=None)
    assert repr(completion) == ("CompletionOutput(index=0, text='hi', token_ids=[5], cumulative_logprob=-1.5, "
                                "logprobs=None, finish_reason=stop, stop_reason=2)")
    request = RequestOutput(request_id="r1", prompt="p", prompt_token_ids=[1], outputs=[completion], finished=True,
                            num_cached_tokens=0)
    assert repr(request) == (f"RequestOutput(request_id=r1, prompt='p', prompt_token_ids=[1], prompt_logprobs=None, "
                             f"outputs=[{completion!r}], finished=True, metrics={{}}, lora_request=None, "
                             "num_cached_tokens=0)")


def _engine_outputs(engine, request_id: str, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while True:
        outputs += [o for o in engine.step() if o.request_id == request_id]
        if outputs and outputs[-1].finished:
            return outputs


def test_delta_output_kind(llm):
    """vLLM's RequestOutputKind: `CUMULATIVE = 0  # Return entire output so far in every RequestOutput`,
    `DELTA = 1  # Return only deltas in each RequestOutput`, `FINAL_ONLY = 2  # Do not return intermediate
    RequestOutput`: the deltas, joined, are the cumulative run's last output; prompt logprobs come once."""
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True, logprobs=1,
                            prompt_logprobs=0, stop=["zzz"])
    cumulative = _engine_outputs(llm.engine, "cumulative", "def f(x):", params)
    deltas = _engine_outputs(llm.engine, "delta", "def f(x):", params.clone(output_kind=RequestOutputKind.DELTA))
    final = cumulative[-1]
    assert len(deltas) > 1
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for index, whole in enumerate(final.outputs):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        assert "".join(c.text for c in parts) == whole.text
        assert [t for c in parts for t in c.token_ids] == whole.token_ids
        assert [lp for c in parts for lp in c.logprobs] == whole.logprobs
        assert all(len(c.logprobs) == len(c.token_ids) for c in parts)
        assert [c.finish_reason for c in parts][-1] == whole.finish_reason == "length"
        assert all(c.finish_reason is None for c in parts[:-1])
        assert parts[-1].cumulative_logprob == pytest.approx(whole.cumulative_logprob)


def test_the_server_passes_vllms_detokenization_fields_through():
    """vLLM's OpenAI server takes skip_special_tokens and spaces_between_special_tokens as extra body fields."""
    from jserve.server.protocol import APIError, parse_chat, parse_completion

    body = {"prompt": "hi", "skip_special_tokens": False, "spaces_between_special_tokens": False}
    params = parse_completion(body).params
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "spaces_between_special_tokens": False})
    assert chat.params.spaces_between_special_tokens is False
    with pytest.raises(APIError, match="spaces_between_special_tokens"):
        parse_completion({"prompt": "hi", "spaces_between_special_tokens": "no"})
