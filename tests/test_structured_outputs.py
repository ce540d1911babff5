"""Constrained decoding (SamplingParams.structured_outputs): every token the engine picks is one llguidance's own
matcher allows, outputs parse (json, lark) or match (re), the sampler's constrained distribution is the free one
renormalised over the allowed tokens, and free requests in a mixed batch get exactly their tokens alone."""

from __future__ import annotations

import json
import re

import jax
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from test_sampler import assert_draws_match, make_seq

from jserve import SamplingParams
from jserve.engine.sampler import build_metadata, sample
from jserve.engine.structured import bitmask_width
from jserve.sampling_params import InvalidParameterError, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"(0|[1-9][0-9]{0,3})-[a-z]{2,4}"
LARK = r"""
start: expr
expr: term (("+" | "-") term)~0..3
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


@pytest.fixture(scope="module", params=["auto", "reference"], ids=["cpu-kernels", "xla"])
def executor(request) -> str:
    return request.param


def matcher_for(llm, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A fresh matcher from llguidance itself (not the engine's), for the same tokenizer and vocabulary."""
    engine = llm.engine
    vocab = max(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    tokenizer = llguidance.hf.from_tokenizer(engine.tokenizer.hf, n_vocab=vocab, eos_token=engine.eos_token_ids)
    return llguidance.LLMatcher(tokenizer, engine.grammars.check(spec))


def assert_allowed_step_by_step(llm, spec: StructuredOutputsParams, token_ids: list[int]) -> None:
    matcher = matcher_for(llm, spec)
    vocab = matcher_vocab = max(llm.engine.model_config.vocab_size, llm.engine.tokenizer.vocab_size)
    mask = np.zeros((1, bitmask_width(matcher_vocab)), np.int32)
    for step, token in enumerate(token_ids):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]
        assert allowed[token], f"step {step}: token {token} is not allowed by llguidance's mask"
        assert matcher.consume_token(token)


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "lark"])
def test_sampled_outputs_follow_the_constraint_on_every_executor(hf_model_dir, llm_factory, executor, kind):
    llm = llm_factory(hf_model_dir("llama"), attention_backend=executor)
    spec = StructuredOutputsParams(**{"json": {"json": SCHEMA}, "regex": {"regex": REGEX},
                                      "choice": {"choice": ["red", "green", "blue sky"]},
                                      "lark": {"grammar": LARK}}[kind])
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=spec) for seed in range(6)]
    outputs = llm.generate([[5, 6, 7, 8]] * len(params), params, use_tqdm=False)
    parser = __import__("lark").Lark(LARK) if kind == "lark" else None
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion  # the constraint completed: EOS was allowed
        assert_allowed_step_by_step(llm, spec, completion.token_ids)
        text = completion.text
        if kind == "json":
            value = json.loads(text)
            assert set(value) <= {"name", "age", "tags"} and len(value["name"]) <= 6 and 0 <= value["age"] <= 120
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in ("red", "green", "blue sky")
        else:
            parser.parse(text)


def test_constrained_distribution_is_the_free_one_renormalised(hf_model_dir, llm_factory):
    """The sampler's draws under llguidance's mask against numpy's softmax over the allowed tokens."""
    llm = llm_factory(hf_model_dir("llama"))
    spec = StructuredOutputsParams(regex=r"[a-z]+|[0-9]+")
    matcher = matcher_for(llm, spec)
    vocab = llm.engine.model_config.vocab_size
    width = bitmask_width(max(vocab, llm.engine.tokenizer.vocab_size))
    row_mask = np.zeros((1, width), np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, row_mask, 0)
    allowed = np.unpackbits(row_mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
    assert 1 < allowed.sum() < vocab
    draws = 4096
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
    logits[allowed] += 3.0  # most of the allowed mass on a few dozen tokens, so the histogram is informative
    seqs = [make_seq(SamplingParams(temperature=0.8), seed=seed) for seed in range(draws)]
    meta = build_metadata(seqs, draws)
    import dataclasses

    meta = dataclasses.replace(meta, token_bitmask=np.repeat(row_mask, draws, axis=0))
    out = jax.tree.map(np.asarray, sample(np.broadcast_to(logits, (draws, vocab)), meta))
    x = np.where(allowed, logits.astype(np.float64) / 0.8, -np.inf)
    probs = np.exp(x - x.max())
    assert_draws_match(out.token_ids, probs / probs.sum())


def test_free_requests_in_a_mixed_batch_get_their_tokens_alone(hf_model_dir, llm_factory, executor):
    """Half constrained, half free, with chunked prefill (48-token prompts, 32-token steps): the free requests'
    tokens (greedy and seeded) are those they get alone."""
    llm = llm_factory(hf_model_dir("llama"), attention_backend=executor, max_num_batched_tokens=32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 500, 48).tolist() for _ in range(6)]
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=24, ignore_eos=True)]
    alone = [llm.generate([prompts[i]], [s], use_tqdm=False)[0].outputs[0].token_ids
             for i, s in zip((0, 2, 4), free, strict=True)]
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(prompts, [free[0], constrained, free[1], constrained, free[2], constrained],
                         use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3, 5):
        json.loads(mixed[i].outputs[0].text)


def test_preemption_and_n_keep_each_sequences_matcher(hf_model_dir, llm_factory):
    """A KV cache too small for every request at once preempts and recomputes sequences; each of n=3 samples keeps
    its own matcher through it, and the greedy outputs equal those of a cache that never preempts."""
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=48, structured_outputs=spec)
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    roomy = llm_factory(hf_model_dir("llama"))
    tight = llm_factory(hf_model_dir("llama"), kv_cache_memory_bytes=160 << 10, max_model_len=128)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for want, have in zip(expected, got, strict=True):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
        for completion in have.outputs:
            json.loads(completion.text)


@pytest.mark.parametrize(("spec", "message"), [
    ({"regex": "a("}, "does not compile"),
    ({"json": '{"type": '}, "not JSON"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "does not compile"),
    ({"grammar": "start: UNDEFINED_RULE"}, "does not compile"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"schema": {}}, "unexpected keyword"),
])
def test_a_bad_constraint_is_a_clear_error_before_anything_is_queued(hf_model_dir, llm_factory, spec, message):
    llm = llm_factory(hf_model_dir("llama"))
    with pytest.raises(InvalidParameterError, match=message) as info:
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
