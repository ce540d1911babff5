"""Speculative decoding: every output is exactly what the model alone gives at temperature 0 (on both executors,
with chunked prefill, preemption, n > 1, penalties, stop strings and logprobs), the rejection sampler's tokens are
distributed exactly as the target's at temperature > 0, and the configuration, metrics and warm-up hold.

The executors are the engine tests' two: "auto" (on CPU the CPU layer executor) and "reference" (the XLA executor
with the pure-JAX attention)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import numpy as np
import pytest
from test_sampler import assert_draws_match, make_seq, ref_probs, softmax

from jserve.config import EngineConfig, SpeculativeConfig
from jserve.engine.rejection import SpecRows, rejection_sample
from jserve.engine.sampler import build_metadata, for_burst
from jserve.engine.speculative import Proposer, ngram_lookup
from jserve.engine_args import add_engine_args, engine_config_from_args
from jserve.sampling_params import SamplingParams, StructuredOutputsParams

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# A budget of 28 blocks of 16 tokens (8 KiB each for the tiny llama), 128-token steps: the corpus's long prompts are
# chunked and its requests preempt one another.
SMALL = dict(max_model_len=256, kv_cache_memory_bytes=28 * 8 * 1024, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module", params=["auto", "reference"], ids=["cpu-kernels", "xla"])
def executor(request) -> str:
    return request.param


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def corpus() -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompt lengths, prompts the n-gram lookup finds matches in, n > 1, penalties, bias and logprobs."""
    rng = np.random.default_rng(11)
    motif = rng.integers(3, 500, 7).tolist()
    items = [(rng.integers(3, 500, int(n)).tolist(), greedy(int(m))) for n, m in [(5, 30), (90, 24), (17, 40)]]
    items += [(motif * 9, greedy(40)), (motif[:3] * 20 + [9], greedy(36)), ([5, 6, 7, 5, 6, 7, 5, 6], greedy(30))]
    items += [(motif * 4, greedy(30, n=2)),
              (motif * 5, greedy(32, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)),
              (motif * 3, greedy(28, logit_bias={motif[0]: 2.0}, logprobs=3)),
              (motif * 3 + [1, 2], greedy(24, min_tokens=10))]
    return items


def generate(llm, items) -> list:
    return llm.generate([{"prompt_token_ids": p} for p, _ in items], [params for _, params in items], use_tqdm=False)


def tokens_and_text(outputs) -> list:
    return [[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def llms(hf_model_dir, llm_factory, executor):
    """(plain, speculative) LLMs of the same small settings."""
    model = hf_model_dir("llama")
    return (llm_factory(model, attention_backend=executor, **SMALL),
            llm_factory(model, attention_backend=executor, speculative_config=NGRAM, **SMALL))


# ----------------------------------------------------------------------------------------- temperature 0


def test_greedy_outputs_are_the_models_own_with_chunks_and_preemption(llms):
    plain, spec = llms
    items = corpus()
    expected = generate(plain, items)
    engine, stats = spec.engine, spec.engine.stats
    preemptions, drafts, accepted = engine.scheduler.num_preemptions, stats.spec_num_drafts, \
        stats.spec_num_accepted_tokens
    got = generate(spec, items)
    assert tokens_and_text(got) == tokens_and_text(expected)
    for e, g in zip(expected, got, strict=True):  # the logprobs of each accepted token too
        for eo, go in zip(e.outputs, g.outputs, strict=True):
            assert (eo.logprobs is None) == (go.logprobs is None)
            for el, gl in zip(eo.logprobs or [], go.logprobs or [], strict=True):
                assert el.keys() == gl.keys()
                np.testing.assert_allclose(list(el.values()), list(gl.values()), atol=1e-4)
    assert stats.spec_num_drafts > drafts and stats.spec_num_accepted_tokens > accepted
    assert engine.scheduler.num_preemptions > preemptions  # the small cache made it preempt
    assert max(len(p) for p, _ in items) > SMALL["max_num_batched_tokens"]  # and the long prompts were chunked
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def test_stop_strings_end_speculative_steps_where_the_model_alone_stops(llms):
    plain, spec = llms
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    free = generate(plain, [(prompt, greedy(40))])[0].outputs[0]
    stop_text = free.text[len(free.text) // 2:][:2]
    assert stop_text.strip()
    items = [(prompt, greedy(40, stop=[stop_text])), (prompt, greedy(40, stop_token_ids=[free.token_ids[20]])),
             (prompt, greedy(40, stop_token_ids=[free.token_ids[20]], include_stop_str_in_output=True))]
    assert tokens_and_text(generate(spec, items)) == tokens_and_text(generate(plain, items))


def test_min_tokens_holds_back_stop_strings(llms):
    """vLLM's rule: text produced by the first min_tokens tokens takes no part in stop-string matching (as EOS and
    stop_token_ids cannot end a request before min_tokens); on both executors, in the decode bursts that follow
    min_tokens and mid-draft."""
    plain, spec = llms
    tokenizer, prompt, min_tokens = plain.get_tokenizer(), np.random.default_rng(9).integers(3, 500, 30).tolist(), 12
    free = generate(plain, [(prompt, greedy(40))])[0].outputs[0]
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    # A token's text that the first min_tokens tokens produce and a later token produces again: only the later ends it.
    stop_text = next(p for p in pieces[:min_tokens] if p.strip() and "\ufffd" not in p and p in pieces[min_tokens:])
    late = free.text.find(stop_text, len(tokenizer.decode(free.token_ids[:min_tokens])))
    items, drafts = [(prompt, greedy(40, min_tokens=min_tokens, stop=[stop_text]))], spec.engine.stats.spec_num_drafts
    for llm in llms:
        out = generate(llm, items)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (free.text[:late], "stop", stop_text)
        assert len(out.token_ids) > min_tokens and out.token_ids == free.token_ids[:len(out.token_ids)]
    assert spec.engine.stats.spec_num_drafts > drafts


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(llms):
    """n-gram drafts are one-hot, so each row draws its token as the plain sampler would and accepts the draft when
    it drew it: a seeded request's tokens do not depend on what was drafted (or whether), only their count per step."""
    plain, spec = llms
    stats = spec.engine.stats
    accepted = stats.spec_num_accepted_tokens
    items = [([5, 6, 7] * 10, SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=30))
             for s, (t, k, p) in enumerate([(0.02, 0, 1.0), (0.8, 20, 1.0), (1.0, 0, 0.9), (0.5, 0, 1.0)])]
    expected = tokens_and_text(generate(plain, items))
    assert tokens_and_text(generate(spec, items)) == expected
    assert tokens_and_text(generate(spec, items)) == expected  # again, now with the prompts' blocks cached
    assert stats.spec_num_accepted_tokens > accepted
    assert len({tuple(o[0][0]) for o in expected}) > 1


def test_constrained_and_prompt_logprobs_requests_share_speculative_steps(llms):
    """A constrained request does not speculate (its mask comes one token at a time) and a prompt still prefilling
    wants every token's logits: both run in steps where another sequence verifies drafts, and get what they get
    without speculation."""
    plain, spec = llms
    stats = spec.engine.stats
    drafts = stats.spec_num_drafts
    rng = np.random.default_rng(8)
    items = [([5, 6, 7, 8] * 6, greedy(30)),
             (rng.integers(3, 500, 20).tolist(), greedy(16, structured_outputs=StructuredOutputsParams(
                 regex="[a-z]{3,12}( [a-z]{2,8}){1,3}"))),
             (rng.integers(3, 500, 90).tolist(), greedy(6, prompt_logprobs=2))]
    expected, got = generate(plain, items), generate(spec, items)
    assert tokens_and_text(got) == tokens_and_text(expected)
    assert stats.spec_num_drafts > drafts
    for e, g in zip(expected[2].prompt_logprobs[1:], got[2].prompt_logprobs[1:], strict=True):
        assert e.keys() == g.keys()
        np.testing.assert_allclose(list(e.values()), list(g.values()), atol=1e-4)


class RandomProposer(Proposer):
    def __init__(self, vocab: int):
        self.rng, self.vocab = np.random.default_rng(0), vocab

    def propose(self, requests) -> list[list[int]]:
        return [self.rng.integers(0, self.vocab, k).tolist() for _, k in requests]


class OracleProposer(Proposer):
    """Proposes the continuation the model alone gave each prompt."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, requests) -> list[list[int]]:
        return [self.continuations[tuple(seq.prompt_token_ids)][seq.num_output_tokens: seq.num_output_tokens + k]
                for seq, k in requests]


def test_random_drafts_are_rejected_and_the_models_drafts_all_accepted(llms, monkeypatch):
    plain, spec = llms
    rng = np.random.default_rng(5)
    items = [(rng.integers(3, 500, int(n)).tolist(), greedy(30)) for n in (4, 40, 70)]
    expected = generate(plain, items)
    stats, scheduler = spec.engine.stats, spec.engine.scheduler

    def run_with(proposer) -> tuple[int, int]:
        before = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        monkeypatch.setattr(scheduler, "proposer", proposer)
        assert tokens_and_text(generate(spec, items)) == tokens_and_text(expected)
        return stats.spec_num_draft_tokens - before[0], stats.spec_num_accepted_tokens - before[1]

    drafted, accepted = run_with(RandomProposer(spec.engine.model_config.vocab_size))
    assert drafted > 100 and accepted / drafted < 0.05
    oracle = OracleProposer({tuple(p): out.outputs[0].token_ids for (p, _), out in zip(items, expected, strict=True)})
    drafted, accepted = run_with(oracle)
    assert drafted > 0 and accepted == drafted


def test_no_speculation_while_the_batch_exceeds_disable_by_batch_size(hf_model_dir, llm_factory):
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1})
    llm = llm_factory(hf_model_dir("llama"), executor="xla", attention_backend="reference",
                      speculative_config=config, **SMALL)
    stats = llm.engine.stats
    generate(llm, [([5, 6, 7] * 8, greedy(20)) for _ in range(3)])  # three running together
    assert stats.spec_num_drafts == 0
    generate(llm, [([5, 6, 7] * 8, greedy(20))])
    assert stats.spec_num_drafts > 0


# ------------------------------------------------------------------------------------- scheduling, no model


class FixedProposer(Proposer):
    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, requests) -> list[list[int]]:
        return [self.drafts[:k] for _, k in requests]


def test_rejected_drafts_roll_back_and_only_accepted_tokens_are_hashed():
    from jserve.engine.kv_cache import BlockManager, block_hash
    from jserve.engine.scheduler import Scheduler
    from jserve.engine.sequence import Sequence

    config = EngineConfig(block_size=4, max_num_batched_tokens=64, speculative_config=NGRAM)
    bm = BlockManager(16, 4, True)
    scheduler = Scheduler(config, bm, 64, proposer=FixedProposer([20, 21, 22, 23]))
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0.0, max_tokens=20))
    seq.sampling_seed = 0
    scheduler.add(seq)
    out = scheduler.schedule()  # the prompt
    seq.append_token(3)
    scheduler.update(out, [1], [])
    out = scheduler.schedule()  # token 3 at position 2 and four drafts: positions 2..6, two blocks
    (chunk,) = out.scheduled
    assert (chunk.num_new_tokens, chunk.draft_token_ids, len(seq.block_table)) == (5, [20, 21, 22, 23], 2)
    assert out.num_batched_tokens == 5 and out.burst == 0
    free = bm.num_free_blocks
    seq.append_token(30)  # every draft rejected: the sampler's own token instead
    scheduler.update(out, [1], [])
    assert (seq.num_computed_tokens, len(seq.block_table), bm.num_free_blocks) == (3, 1, free + 1)
    assert bm.blocks[seq.block_table[0]].hash is None  # position 3 is not computed yet
    out = scheduler.schedule()  # token 30 at position 3 and four drafts again
    for token in (20, 21, 5):  # two drafts accepted, then the sampler's token
        seq.append_token(token)
    scheduler.update(out, [3], [])
    assert seq.num_computed_tokens == 6 and len(seq.block_table) == bm.num_blocks_for(seq.num_tokens) == 2
    first = bm.blocks[seq.block_table[0]]
    assert first.hash == block_hash(None, (1, 2, 3, 30), first.salt)  # the accepted tokens, not the drafts
    assert bm.blocks[seq.block_table[1]].hash is None  # positions 4, 5 computed, 6 (token 5) not yet
    bm.check_invariants([seq])


# ------------------------------------------------------------------------------------------- the proposer


def test_ngram_lookup_takes_the_longest_match_and_its_first_occurrence():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert ngram_lookup(tokens, 1, 3, 3).tolist() == [4, 9, 2]  # [1, 2, 3] matched at 0
    assert ngram_lookup(tokens, 1, 2, 2).tolist() == [4, 9]  # [2, 3] first at 1
    assert ngram_lookup(np.array([7, 8, 9]), 1, 3, 4).tolist() == []
    assert ngram_lookup(np.array([4, 4, 4, 4]), 2, 2, 5).tolist() == [4, 4]
    assert ngram_lookup(np.array([1, 2, 1, 2]), 3, 3, 5).tolist() == []


# ----------------------------------------------------------------------------------- the rejection sampler

V = 8
SEGMENTS = 4096


def spec_batch(logits: np.ndarray, params: SamplingParams, drafts: np.ndarray, seed0: int = 0):
    """SEGMENTS sequences of (one draft row, one bonus row) over the two target rows in `logits` [2, V]."""
    seqs = [make_seq(params, seed=seed0 + i) for i in range(SEGMENTS) for _ in range(2)]
    meta = build_metadata(seqs, pad_to=2 * SEGMENTS)
    meta = for_burst(dataclasses.replace(meta, steps=np.tile(np.array([0, 1], np.int32), SEGMENTS)))
    draft_ids = np.stack([drafts, np.full(SEGMENTS, -1)], axis=1).reshape(-1).astype(np.int32)
    seg_start = np.repeat(np.arange(0, 2 * SEGMENTS, 2, dtype=np.int32), 2)
    return np.tile(logits, (SEGMENTS, 1)).astype(np.float32), meta, SpecRows(draft_ids, seg_start)


@pytest.mark.parametrize("case", ["one-hot", "far-draft", "filters"])
def test_rejection_sampling_draws_the_targets_distribution(case: str) -> None:
    """The first token of every sequence follows the target's distribution at its first row, and the second (once the
    draft is accepted) the target's at the second row; chi-square and total variation (test_sampler's checks)."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((2, V)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.0) if case != "filters" else \
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05)
    target = ref_probs(logits[0], make_seq(params))
    draft_probs = None
    if case == "one-hot":  # the n-gram proposer's: one fixed token, p_draft one-hot
        drafts = np.full(SEGMENTS, int(np.argsort(target)[-2]))
    else:  # a draft model far from the target: its own distribution, its drafts drawn from it
        # far-draft: total variation 0.85 from the target; filters: uniform, so it drafts tokens the filters remove
        q = softmax(-0.5 * logits[0].astype(np.float64)) if case == "far-draft" else np.full(V, 1 / V)
        drafts = rng.choice(V, SEGMENTS, p=q)
        draft_probs = np.tile(np.stack([q, np.zeros(V)]), (SEGMENTS, 1)).astype(np.float32)
    x, meta, rows = spec_batch(logits, params, drafts)
    out = np.asarray(rejection_sample(x, meta, rows, draft_probs=draft_probs).token_ids).reshape(SEGMENTS, 2)
    assert (out[:, 0] >= 0).all()
    assert_draws_match(out[:, 0], target)
    accepted = out[:, 0] == drafts
    assert ((out[:, 1] >= 0) == accepted).all()  # a sequence goes on past its draft only when it accepted it
    assert 0.05 < accepted.mean() < 0.95
    assert_draws_match(out[accepted, 1], ref_probs(logits[1], make_seq(params)))
    if case == "one-hot":  # acceptance is p_target(draft)
        assert abs(accepted.mean() - target[drafts[0]]) < 4 * np.sqrt(target[drafts[0]] / SEGMENTS)


def test_greedy_verification_accepts_the_argmax_prefix_and_one_more() -> None:
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((8, V)).astype(np.float32)
    best = logits.argmax(axis=1)
    # sequences: 3 drafts all right (+ bonus), 2 drafts with the second wrong, none (one row), padding
    draft_ids = np.array([best[0], best[1], best[2], -1, best[4], (best[5] + 1) % V, -1, -1], np.int32)
    seg_start = np.array([0, 0, 0, 0, 4, 4, 4, 7], np.int32)
    meta = for_burst(build_metadata([make_seq(SamplingParams(temperature=0.0))] * 8, pad_to=8))
    out = np.asarray(rejection_sample(logits, meta, SpecRows(draft_ids, seg_start)).token_ids)
    assert out.tolist() == [best[0], best[1], best[2], best[3], best[4], best[5], -1, best[7]]


# ------------------------------------------------------------------------------- configuration and metrics


@pytest.mark.parametrize(("config", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, "draft"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config_is_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=config)


def test_the_cli_flag_takes_json():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    config = engine_config_from_args(args).speculative_config
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None


def test_metrics_count_drafts_and_acceptances(llms):
    from jserve.server.metrics import ServerMetrics

    _, spec = llms
    engine, stats = spec.engine, spec.engine.stats
    before = dataclasses.replace(stats, spec_accepted_per_pos=list(stats.spec_accepted_per_pos))
    generate(spec, [([5, 6, 7, 8] * 10, greedy(30))])
    drafts = stats.spec_num_drafts - before.spec_num_drafts
    draft_tokens = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = np.subtract(stats.spec_accepted_per_pos, before.spec_accepted_per_pos)
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 4 * drafts
    assert per_pos.sum() == accepted and (np.diff(per_pos) <= 0).all()  # position j needs every one before it
    assert 0 < stats.spec_acceptance_rate <= 1 and 1 < stats.spec_mean_accepted_length <= 5
    snapshot = engine.snapshot()
    assert (snapshot.spec_num_drafts, snapshot.spec_num_accepted_tokens) == (stats.spec_num_drafts,
                                                                              stats.spec_num_accepted_tokens)
    text = ServerMetrics("m", lambda: snapshot).render().decode()
    assert f'jserve:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.spec_num_drafts)}' in text
    assert f'jserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} ' \
           f'{float(stats.spec_num_accepted_tokens)}' in text
    assert 'jserve:spec_decode_num_draft_tokens_total' in text
    assert 'jserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text


def test_no_recompilation_after_warmup_with_speculation(hf_model_dir, executor):
    """Mixed requests (lookup-friendly and random prompts, greedy and sampled, aborts) compile nothing after warm-up:
    the speculative steps' logits rows and the rejection sampler were compiled with the rest (8 sequence rows, so
    steps of 16 tokens and more also take one logits row per token)."""
    def prompt(i: int, rng: np.random.Generator) -> list[int]:
        motif = rng.integers(3, 500, int(rng.integers(2, 6))).tolist()
        return motif * int(rng.integers(1, 20)) if i % 2 else rng.integers(3, 500, 50).tolist()

    assert_no_compiles_serving(hf_model_dir("llama"), executor, NGRAM, prompt, num_requests=24, max_tokens=60)


def assert_no_compiles_serving(model, executor: str, speculative_config: str, prompt, num_requests: int,
                               max_tokens: int) -> None:
    """After warm-up, requests arriving a few at a time (prompt(i, rng) each; greedy, seeded, top-p and top-k
    sampled in turn), some aborted, compile nothing, draft, and leave every block free."""
    from jax._src import dispatch

    from jserve import LLM

    llm = LLM(str(model), max_model_len=256, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=32,
              max_num_seqs=8, warmup=True, compilation_cache_dir="", attention_backend=executor,
              speculative_config=speculative_config)
    engine, rng = llm.engine, np.random.default_rng(0)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT else None)
    try:
        choices = [dict(temperature=0.0), dict(temperature=0.9, seed=1), dict(temperature=1.0, top_p=0.8),
                   dict(temperature=0.7, top_k=20)]
        pending = list(range(num_requests))
        while pending or engine.has_unfinished_requests():
            for _ in range(int(rng.integers(0, 4))):
                if pending:
                    i = pending.pop()
                    params = SamplingParams(max_tokens=int(rng.integers(1, max_tokens)), **choices[i % len(choices)])
                    engine.add_request(f"r{i}", {"prompt_token_ids": prompt(i, rng)}, params)
            if engine.outputs.requests and rng.random() < 0.05:
                engine.abort_request(str(rng.choice(sorted(engine.outputs.requests))))
            engine.step()
    finally:
        jax.monitoring.clear_event_listeners()
    assert compiles == []
    assert engine.stats.spec_num_drafts > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
