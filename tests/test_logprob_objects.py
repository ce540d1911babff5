"""Logprobs as vLLM's Logprob objects: each entry of CompletionOutput.logprobs and RequestOutput.prompt_logprobs has
.logprob, .rank (the count of vocabulary logprobs >= the token's, so the argmax is 1 and the top-k are 1..k) and
.decoded_token (tokenizer.decode([id]) with special tokens shown), and is still the float it was (arithmetic,
comparisons, json.dumps).

Every logprob and rank is checked against transformers' own logits for the same tokens (log_softmax in float32, the
rank counted with NumPy), on both executors ("auto": on CPU the CPU layer executor; "reference": the XLA executor),
for greedy and seeded sampled requests (temperature 5 samples tokens outside the top 5), prompt logprobs, and the
speculative (n-gram) path's verified tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_models import load_hf
from transformers import AutoTokenizer

from jserve import Logprob
from jserve.sampling_params import SamplingParams

K = 5
TOL = 1e-4  # jserve's logprobs vs transformers'


@pytest.fixture(scope="module", params=["auto", "reference"], ids=["cpu-kernels", "xla"])
def executor(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(hf_model_dir):
    """(model dir, transformers model, its tokenizer)."""
    model_dir = hf_model_dir("llama")
    return model_dir, load_hf(model_dir), AutoTokenizer.from_pretrained(model_dir)


def hf_logprobs(hf, tokens: list[int]) -> np.ndarray:
    """f32[len(tokens), V]: transformers' log_softmax of the logits at each position (row i predicts token i + 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def rank_bounds(row: np.ndarray, value: float) -> tuple[int, int]:
    """The rank (count of logprobs >= the token's) the token may have given TOL of difference from jserve's numbers:
    exact unless another token's logprob lies within TOL of it."""
    return 1 + int(np.count_nonzero(row > value + TOL)), int(np.count_nonzero(row >= value - TOL))


def check_entry(entry: dict, token: int, row: np.ndarray, tokenizer, detokenize: bool = True) -> int:
    """One position's {id: Logprob} against transformers' logprobs `row` -> the rank of `token`."""
    assert set(entry) == {token, *np.argsort(-row)[:K].tolist()}
    assert list(entry)[0] == token  # the given token first, as vLLM's (and as jserve's servers read it)
    for t, lp in entry.items():
        assert isinstance(lp, Logprob) and isinstance(lp, float)
        assert type(lp.logprob) is float and lp.logprob == float(lp)
        assert lp.logprob == pytest.approx(row[t], abs=TOL)
        assert json.dumps(lp) == json.dumps(float(lp)) and json.loads(json.dumps({t: lp})) == {str(t): float(lp)}
        lo, hi = rank_bounds(row, float(row[t]))
        assert isinstance(lp.rank, int) and lo <= lp.rank <= hi, (t, lp.rank, lo, hi)
        expected_text = tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert lp.decoded_token == (expected_text if detokenize else None)
    top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:K]
    assert [lp.rank for lp in top] == list(range(1, K + 1))
    return entry[token].rank


def check_output(output, hf, tokenizer, detokenize: bool = True) -> list[int]:
    """Every sampled and prompt position of a RequestOutput (one sample) -> the sampled tokens' ranks."""
    prompt, completion = output.prompt_token_ids, output.outputs[0]
    expected = hf_logprobs(hf, prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    ranks = [check_entry(entry, token, expected[len(prompt) - 1 + i], tokenizer, detokenize)
             for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True))]
    assert completion.cumulative_logprob == pytest.approx(
        sum(float(e[t]) for t, e in zip(completion.token_ids, completion.logprobs, strict=True)), abs=1e-5)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        check_entry(output.prompt_logprobs[position], prompt[position], expected[position - 1], tokenizer, detokenize)
    return ranks


def test_logprobs_are_vllm_logprob_objects_with_transformers_ranks(model, llm_factory, executor):
    model_dir, hf, tokenizer = model
    llm = llm_factory(model_dir, attention_backend=executor)
    prompt = np.random.default_rng(21).integers(3, 500, 10).tolist()
    base = dict(max_tokens=6, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    params = [SamplingParams(temperature=0.0, **base),
              SamplingParams(temperature=1.0, seed=7, **base),
              SamplingParams(temperature=5.0, seed=3, **base),  # close to uniform: ranks far past the top 5
              SamplingParams(temperature=0.0, detokenize=False, **base)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    greedy, sampled, hot, no_text = (check_output(out, hf, tokenizer, detokenize=p.detokenize)
                                     for out, p in zip(outputs, params, strict=True))
    assert greedy == [1] * len(greedy)  # the argmax, under the raw logits (no bias or penalty here)
    assert no_text == greedy
    assert max(hot) > K  # sampled tokens outside the top K carry their vocabulary rank
    assert all(r >= 1 for r in sampled)
    # The same Logprob objects as vLLM's: constructible by keyword, with vLLM's repr.
    entry = outputs[0].outputs[0].logprobs[0]
    token = outputs[0].outputs[0].token_ids[0]
    assert repr(entry[token]).startswith("Logprob(logprob=") and "rank=1" in repr(entry[token])
    assert Logprob(logprob=-1.5, rank=2, decoded_token="a").logprob == -1.5


def test_speculative_steps_return_logprob_objects(model, llm_factory):
    """Tokens the rejection sampler emits (accepted drafts and the token after them) carry their ranks too."""
    model_dir, hf, tokenizer = model
    llm = llm_factory(model_dir, attention_backend="reference", speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))
    stats = llm.engine.stats
    drafts, accepted = stats.spec_num_drafts, stats.spec_num_accepted_tokens
    prompt = [5, 6, 7, 8] * 5
    base = dict(max_tokens=12, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    params = [SamplingParams(temperature=0.0, **base), SamplingParams(temperature=5.0, seed=3, **base)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    assert stats.spec_num_drafts > drafts and stats.spec_num_accepted_tokens > accepted  # drafts emitted too
    greedy, hot = (check_output(out, hf, tokenizer) for out in outputs)
    assert greedy == [1] * len(greedy)
    assert max(hot) > K
