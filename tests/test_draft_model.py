"""Speculative decoding with a draft model: at temperature 0 every output is the target's alone (the engine corpus of
test_speculative: chunked prefill, preemption, n > 1, penalties, stop strings, logprobs), on both executors; a draft
equal to the target has every draft accepted, a random one almost none; at temperature > 0 the tokens are distributed
as the target's (chi-square against the target's own probabilities); a draft that cannot serve the target is refused
naming the field; nothing compiles after warm-up."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_sampler import assert_draws_match
from test_speculative import SMALL, assert_no_compiles_serving, corpus, generate, greedy, tokens_and_text

from jserve.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["auto", "reference"], ids=["cpu-kernels", "xla"])
def executor(request) -> str:
    return request.param


def draft_config(model, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def random_draft(hf_model_dir):
    """Another model of the target's tokenizer: other weights, one layer."""
    return hf_model_dir("llama", seed=1, num_hidden_layers=1)


# The draft's K/V takes its share of the budget: twice SMALL's bytes keep the target's blocks (and its preemptions).
DRAFTED = {**SMALL, "kv_cache_memory_bytes": SMALL["kv_cache_memory_bytes"] * 3 // 2}


def test_greedy_outputs_are_the_targets_own_with_a_random_draft(hf_model_dir, llm_factory, executor, random_draft):
    model = hf_model_dir("llama")
    plain = llm_factory(model, attention_backend=executor, **DRAFTED)
    spec = llm_factory(model, attention_backend=executor, speculative_config=draft_config(random_draft), **DRAFTED)
    items = corpus()
    expected = generate(plain, items)
    engine = spec.engine
    assert tokens_and_text(generate(spec, items)) == tokens_and_text(expected)
    stats = engine.stats
    assert stats.spec_num_draft_tokens > 200 and stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.1
    assert engine.scheduler.num_preemptions > 0  # the corpus outgrows the cache: drafts survive recomputation
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_draft_equal_to_the_target_has_every_draft_accepted(hf_model_dir, llm_factory, executor):
    model = hf_model_dir("llama")
    plain = llm_factory(model, attention_backend=executor, **DRAFTED)
    spec = llm_factory(model, attention_backend=executor, speculative_config=draft_config(model), **DRAFTED)
    rng = np.random.default_rng(3)
    items = [(rng.integers(3, 500, int(n)).tolist(), greedy(int(m))) for n, m in [(4, 30), (60, 25), (130, 20)]]
    expected = generate(plain, items)
    stats = spec.engine.stats
    assert tokens_and_text(generate(spec, items)) == tokens_and_text(expected)
    assert stats.spec_num_draft_tokens > 40 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_sampled_tokens_are_distributed_as_the_targets(hf_model_dir, llm_factory, random_draft):
    """The second token of a top-k sampled request (the first a draft verifies) against its exact distribution:
    sum over the first token of p(first) p(second | first), each from the target alone. The random draft proposes
    from its whole vocabulary, mostly outside the target's top k, so most tokens come from the residual draw."""
    model = hf_model_dir("llama")
    plain = llm_factory(model, executor="xla", attention_backend="reference", **DRAFTED)
    spec = llm_factory(model, executor="xla", attention_backend="reference",
                       speculative_config=draft_config(random_draft, k=1), **DRAFTED)
    prompt = [7, 81, 15, 300, 42]
    top_k, vocab = 3, spec.engine.model_config.vocab_size

    def top_k_probs(tokens: list[int]) -> dict[int, float]:
        out = plain.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                            logprobs=top_k), use_tqdm=False)
        top = out[0].outputs[0].logprobs[0]
        logprobs = np.array(list(top.values()))
        return dict(zip(top, np.exp(logprobs) / np.exp(logprobs).sum(), strict=True))

    exact = np.zeros(vocab)
    for first, p_first in top_k_probs(prompt).items():
        for second, p_second in top_k_probs(prompt + [first]).items():
            exact[second] += p_first * p_second
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True, n=50)
    outs = spec.generate([{"prompt_token_ids": prompt}] * 30, params, use_tqdm=False)
    draws = np.array([o.token_ids[1] for out in outs for o in out.outputs])
    stats = spec.engine.stats
    assert stats.spec_num_draft_tokens >= 1500 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_draws_match(draws, exact)
    seeded = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)
    first, again = (spec.generate([{"prompt_token_ids": prompt}], seeded, use_tqdm=False)[0] for _ in range(2))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids  # a seeded request is reproducible


# ------------------------------------------------------------------------------------------ bad configuration


def test_a_draft_that_cannot_serve_the_target_is_refused_naming_the_field(hf_model_dir, tmp_path):
    from jserve import LLM

    model = hf_model_dir("llama")
    settings = dict(max_model_len=256, kv_cache_memory_bytes=1 << 20, warmup=False, compilation_cache_dir="")

    def refused(draft, match: str, **overrides) -> None:
        with pytest.raises(ValueError, match=match):
            LLM(str(model), speculative_config=draft_config(draft), **{**settings, **overrides})

    refused(hf_model_dir("llama", vocab_size=600), r"speculative_config.model .* vocabulary of 600")
    other_tokenizer = tmp_path / "other-tokenizer"
    shutil.copytree(model, other_tokenizer)
    tokenizer = json.loads((other_tokenizer / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[10:12]
    vocab[a], vocab[b] = ib, ia  # two tokens' ids swapped
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused(other_tokenizer, r"speculative_config.model .* another tokenizer")
    refused(hf_model_dir("llama", max_position_embeddings=128), r"speculative_config.model .* 128 positions")
    refused(tmp_path / "missing", r"speculative_config.model .* cannot be loaded")
    # the target alone fits 16 blocks of 16 tokens; with the draft's K/V the same budget holds fewer
    refused(model, r"speculative_config.model's K/V", kv_cache_memory_bytes=16 * 8 * 1024)


# ------------------------------------------------------------------------------------------------ warm-up


@pytest.mark.parametrize("executor", ["reference"], ids=["xla"])
def test_no_recompilation_after_warmup_with_a_draft_model(hf_model_dir, random_draft, executor):
    """Greedy and sampled requests, long prompts (the draft's catch-up passes) and aborts compile nothing after
    warm-up: the draft's steps, its sampler and the gather of its distributions were compiled with the rest. On
    the XLA path, what accelerators compile; the CPU layer executor's bucket grid is test_engine's recompile test,
    its draft steps the greedy tests' here."""
    assert_no_compiles_serving(hf_model_dir("llama"), executor, draft_config(random_draft),
                               lambda i, rng: rng.integers(3, 500, int(rng.integers(2, 120))).tolist(),
                               num_requests=16, max_tokens=40)
