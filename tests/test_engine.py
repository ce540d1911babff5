"""The engine end to end: continuous batching, preemption, prefix caching and chunked prefill all give exactly
the tokens a request gets alone, and the tokens transformers gives for the same weights.

The tests that compare with transformers run on both executors (the `executor` fixture, an attention_backend):
"auto" (on CPU the CPU layer executor) and "reference", the XLA executor a GPU or TPU runs (the Flax layers, the
jitted sampler and bursts) with the pure-JAX attention in place of the Pallas kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import load_hf
from transformers import AutoTokenizer

import cpu_kernels
from jserve.config import EngineConfig
from jserve.sampling_params import RequestOutputKind, SamplingParams

NUM_REQUESTS = 64


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation with its own KV cache (no EOS stop)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.fixture(scope="module", params=["auto", "reference"], ids=["cpu-kernels", "xla"])
def executor(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], int]]:
    """64 (prompt, max_tokens) pairs: prompts of 1..300 tokens, outputs of 1..200 tokens."""
    rng = np.random.default_rng(7)
    return [(rng.integers(3, 500, int(rng.integers(1, 301))).tolist(), int(rng.integers(1, 201)))
            for _ in range(NUM_REQUESTS)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, workload) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], [greedy(m) for _, m in workload],
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def batched_tokens(hf_model_dir, llm_factory, workload, executor) -> list[list[int]]:
    llm = llm_factory(hf_model_dir("llama"), kv_cache_memory_bytes=16 << 20, max_num_seqs=32,
                      attention_backend=executor)
    tokens = run(llm, workload)
    assert llm.engine.scheduler.num_preemptions == 0  # the preemption test covers that path separately
    return tokens


@pytest.fixture(scope="module")
def hf_workload_tokens(hf_model_dir, workload) -> list[list[int]]:
    """transformers' greedy tokens for the workload, once for both executors."""
    hf = load_hf(hf_model_dir("llama"))
    return [hf_greedy(hf, prompt, max_tokens) for prompt, max_tokens in workload]


def test_batched_requests_match_transformers(batched_tokens, hf_workload_tokens):
    for i, (tokens, expected) in enumerate(zip(batched_tokens, hf_workload_tokens, strict=True)):
        assert tokens == expected, i


def test_batched_requests_match_each_request_alone(hf_model_dir, llm_factory, workload, batched_tokens, executor):
    llm = llm_factory(hf_model_dir("llama"), kv_cache_memory_bytes=16 << 20, max_num_seqs=32,
                      attention_backend=executor)
    for (prompt, max_tokens), tokens in zip(workload, batched_tokens, strict=True):
        alone = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens), use_tqdm=False)
        assert alone[0].outputs[0].token_ids == tokens


def test_preemption_keeps_outputs_identical_and_frees_every_block(hf_model_dir, llm_factory, workload,
                                                                   batched_tokens, executor):
    # 80 blocks of 16 tokens hold about three of the longest requests, so the 64 requests must preempt.
    llm = llm_factory(hf_model_dir("llama"), kv_cache_memory_bytes=80 * 8 * 1024, max_num_seqs=32,
                      attention_backend=executor)
    engine = llm.engine
    assert run(llm, workload) == batched_tokens
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def test_prefix_cache_computes_only_the_new_tokens(hf_model_dir, llm_factory, executor):
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 500, 512).tolist()
    first, second = prefix + rng.integers(3, 500, 20).tolist(), prefix + rng.integers(3, 500, 37).tolist()
    params = greedy(24)
    cached = llm_factory(hf_model_dir("llama"), max_model_len=1024, attention_backend=executor)
    cached.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    before = cached.engine.stats.num_computed_prompt_tokens
    out = cached.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert cached.engine.stats.num_computed_prompt_tokens - before == len(second) - 512
    assert out.num_cached_tokens == 512
    uncached = llm_factory(hf_model_dir("llama"), max_model_len=1024, enable_prefix_caching=False,
                           attention_backend=executor)
    reference = uncached.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert reference.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_chunked_prefill_matches_one_shot_prefill(hf_model_dir, llm_factory, executor):
    prompt = np.random.default_rng(5).integers(3, 500, 2000).tolist()
    params = greedy(12)
    settings = dict(max_model_len=2048, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False,
                    attention_backend=executor)
    chunked = llm_factory(hf_model_dir("llama"), max_num_batched_tokens=256, **settings)
    one_shot = llm_factory(hf_model_dir("llama"), max_num_batched_tokens=2048, **settings)
    steps_before = chunked.engine.stats.num_steps
    out = chunked.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert chunked.engine.stats.num_steps - steps_before >= 2000 // 256 + params.max_tokens - 1
    assert out.outputs[0].token_ids == one_shot.generate({"prompt_token_ids": prompt}, params,
                                                         use_tqdm=False)[0].outputs[0].token_ids


def test_seeded_sampling_is_reproducible_across_batch_compositions(hf_model_dir, llm_factory, executor):
    llm = llm_factory(hf_model_dir("llama"), attention_backend=executor)
    rng = np.random.default_rng(11)
    target = rng.integers(3, 500, 40).tolist()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=30, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": target}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(1, 200, 7)]
    prompts = [{"prompt_token_ids": p} for p in others[:3] + [target] + others[3:]]
    params = [SamplingParams(temperature=0.8, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 60, 8)]
    params[3] = seeded
    in_batch = llm.generate(prompts, params, use_tqdm=False)[3].outputs[0].token_ids
    assert in_batch == alone
    other_seed = llm.generate({"prompt_token_ids": target}, SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_and_differ(hf_model_dir, llm_factory):
    llm = llm_factory(hf_model_dir("llama"))
    prompt = np.random.default_rng(2).integers(3, 500, 64).tolist()
    before = llm.engine.stats.num_computed_prompt_tokens
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    # The samples share the prompt's full blocks: the siblings compute only the last, partial one (16 tokens).
    assert llm.engine.stats.num_computed_prompt_tokens - before == 64 + 2 * 16
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_decode_bursts_give_the_tokens_and_text_of_single_steps(hf_model_dir, llm_factory, monkeypatch):
    """Several decode steps in one device call (decode_burst): greedy and seeded draws, stop tokens, stop strings
    and length limits falling inside a burst all end exactly where single steps end, and every block comes back.
    The reference runs every step through the plain forward and then the sampler."""
    rng = np.random.default_rng(21)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, int(n)).tolist()} for n in rng.integers(1, 120, 6)]
    single = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=1e-3)
    monkeypatch.setattr(single.engine.scheduler, "burst_buckets", None)
    monkeypatch.setattr(single.engine.executor, "execute_burst",
                        lambda *args: pytest.fail("a burst in the reference"))
    free = single.generate(prompts[0], greedy(40), use_tqdm=False)[0].outputs[0]
    params = [greedy(37), SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=50, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=8, n=2, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[free.token_ids[13]]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[free.text[-12:][:2]]),
              SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=9, ignore_eos=True)]
    prompts[3] = prompts[4] = prompts[0]
    prompts[5] = {"prompt_token_ids": [7]}  # a one-token prompt: its first step is a prompt step, not a decode
    expected = single.generate(prompts, params, use_tqdm=False)

    bursts = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=float("inf"))
    executor, calls = bursts.engine.executor, []
    run_burst = executor.execute_burst
    monkeypatch.setattr(executor, "execute_burst", lambda *args: calls.append(args[2]) or run_burst(*args))
    layer_kernel = getattr(executor, "layer_stack", None) is not None
    kept = cpu_kernels.cached_layer_calls() if layer_kernel else 0
    for together in (True, False):  # all at once, and each alone (a batch of one bursts the most)
        got = bursts.generate(prompts, params, use_tqdm=False) if together else \
            [bursts.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)]
        for want, have in zip(expected, got, strict=True):
            assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in have.outputs] == \
                   [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want.outputs]
    if layer_kernel:  # a burst's later steps find the buffers of the step before: its layer call's phases run again
        assert cpu_kernels.cached_layer_calls() > kept
    # Full bursts, shorter ones that end on a max_tokens limit, and single fused steps.
    assert max(calls) == 8 and 1 < min(c for c in calls if c > 1) < 8 and 1 in calls
    assert expected[3].outputs[0].finish_reason == "stop" and expected[4].outputs[0].finish_reason == "stop"
    assert bursts.engine.block_manager.num_free_blocks == bursts.engine.block_manager.num_blocks
    bursts.engine.block_manager.check_invariants()


def test_a_burst_ends_on_the_device_once_every_sequence_has_stopped(hf_model_dir, llm_factory, monkeypatch):
    """A burst stops stepping once each of its sequences has sampled an EOS id (unless ignore_eos) or one of its
    stop_token_ids: a generation that stops inside a burst runs no step past its last token. The tokens are those
    of single steps (the plain forward, then the sampler)."""
    prompt = {"prompt_token_ids": np.random.default_rng(3).integers(3, 500, 20).tolist()}
    single = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=1e-3)
    monkeypatch.setattr(single.engine.scheduler, "burst_buckets", None)
    free = single.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    # A token first sampled inside the second burst (tokens 10-17: the prompt step gives token 1).
    end = next(i for i in range(10, 16) if free[i] not in free[:i])
    llm = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=float("inf"))
    engine = llm.engine

    def run(params):
        steps = engine.stats.num_steps
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        return [o.outputs[0] for o in outs], engine.stats.num_steps - steps

    (out,), steps = run([greedy(24).clone(stop_token_ids=[free[end]])])
    assert out.token_ids == free[:end + 1] and out.finish_reason == "stop" and steps == end + 1
    monkeypatch.setattr(engine, "eos_token_ids", [free[end]])  # requests take the engine's EOS ids
    (out,), steps = run([SamplingParams(temperature=0.0, max_tokens=24)])
    assert out.token_ids == free[:end + 1] and out.finish_reason == "stop" and steps == end + 1
    (out,), steps = run([greedy(24)])  # ignore_eos: the EOS id does not end it, on the device either
    assert out.token_ids == free and steps == 24
    (stops, runs_on), steps = run([SamplingParams(temperature=0.0, max_tokens=24), greedy(24)])
    assert stops.token_ids == free[:end + 1] and runs_on.token_ids == free and steps == 24


def test_a_burst_shrinks_until_the_free_blocks_hold_its_slots(hf_model_dir, llm_factory, monkeypatch):
    """With fewer free KV blocks than a full burst's slots need, the burst is halved until they fit (not cut to a
    single step); the tokens are those of single steps."""
    from jserve.engine.sequence import Sequence

    prompt = {"prompt_token_ids": np.random.default_rng(8).integers(3, 500, 14).tolist()}
    single = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=1e-3)
    monkeypatch.setattr(single.engine.scheduler, "burst_buckets", None)
    expected = single.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    llm = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=float("inf"))
    bm, executor, calls = llm.engine.block_manager, llm.engine.executor, []
    # All free blocks but the prompt's one are held, until the first burst has run: the prompt step fills positions
    # 0-13, so a first burst of 8 (positions 14-21) would need a second block; 2 steps fit in the first.
    hog = Sequence("hog", [0], greedy(1))
    assert bm.allocate_slots(hog, (bm.num_free_blocks - 1) * bm.block_size)
    run_burst = executor.execute_burst

    def burst_then_release(*args):
        calls.append(args[2])
        if hog.block_table:
            bm.free(hog)
        return run_burst(*args)

    monkeypatch.setattr(executor, "execute_burst", burst_then_release)
    assert llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids == expected
    assert calls == [2, 8, 1]  # then the full burst, and the last token's step
    assert bm.num_free_blocks == bm.num_blocks


def test_a_burst_over_a_growing_long_context_gives_the_tokens_of_single_steps(hf_model_dir, llm_factory,
                                                                              monkeypatch):
    """A batch-1 burst whose context grows past 16 pages of 16 tokens in mid-burst, where the CPU layer kernel starts
    splitting the decode into parts, then moves the parts' pages with every new page: the phases a layer call keeps
    from the step before (cpu_kernels.cached_layer_calls) must follow its attention items. The reference runs every
    step through the plain forward and then the sampler."""
    prompt = {"prompt_token_ids": np.random.default_rng(5).integers(3, 500, 250).tolist()}
    params = greedy(40)
    single = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=1e-3)
    monkeypatch.setattr(single.engine.scheduler, "burst_buckets", None)
    expected = single.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    bursts = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=float("inf"))
    layer_kernel = getattr(bursts.engine.executor, "layer_stack", None) is not None
    kept = cpu_kernels.cached_layer_calls() if layer_kernel else 0
    assert bursts.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    if layer_kernel:
        assert cpu_kernels.cached_layer_calls() > kept


def test_final_only_requests_report_once_with_what_streaming_requests_end_with(hf_model_dir, llm_factory):
    """FINAL_ONLY (what LLM.generate sends) returns nothing per step, then the finished output a streaming
    (CUMULATIVE) request ends with; its text, decoded once at the end, is transformers' decode of the tokens."""
    from transformers import AutoTokenizer

    model_dir = hf_model_dir("llama")
    engine = llm_factory(model_dir).engine
    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in (5, 40, 12, 70)]
    free = llm_factory(model_dir).generate({"prompt_token_ids": prompts[2]}, greedy(30), use_tqdm=False)[0]
    params = [greedy(25), SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[free.outputs[0].text[-9:][:2]]),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             stop_token_ids=[free.outputs[0].token_ids[8]])]
    prompts[3] = prompts[2]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"stream-{i}", {"prompt_token_ids": prompt}, p)
        final_only = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"final-{i}", {"prompt_token_ids": prompt}, final_only)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for i in range(len(prompts)):
        streamed, final = seen[f"stream-{i}"], seen[f"final-{i}"]
        assert len(final) == 1 and final[0].finished and len(streamed) > 1
        describe = lambda out: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
        assert describe(final[0]) == describe(streamed[-1])
    assert seen["final-2"][0].outputs[0].finish_reason == "stop"  # the stop string still ends it
    assert seen["final-3"][0].outputs[0].finish_reason == "stop"
    for i in (0, 1):
        for c in seen[f"final-{i}"][0].outputs:
            assert c.text == hf_tokenizer.decode(c.token_ids)

    engine.add_request("aborted", {"prompt_token_ids": prompts[1]},
                       greedy(200).clone(output_kind=RequestOutputKind.FINAL_ONLY))
    for _ in range(3):
        assert engine.step() == []
    aborted = engine.abort_request("aborted").outputs[0]
    assert aborted.token_ids and aborted.text == hf_tokenizer.decode(aborted.token_ids)


def test_only_streaming_requests_hold_bursts_to_the_time_budget(hf_model_dir, llm_factory, monkeypatch):
    """decode_burst_ms bounds how long a burst holds back streamed tokens; requests reported only when finished
    (LLM.generate) burst the full decode_burst, with the tokens streaming requests get."""
    llm = llm_factory(hf_model_dir("llama"), decode_burst=8, decode_burst_ms=1e-3)
    engine, calls = llm.engine, []
    run_burst = engine.executor.execute_burst
    monkeypatch.setattr(engine.executor, "execute_burst", lambda *args: calls.append(args[2]) or run_burst(*args))
    prompts = [np.random.default_rng(5).integers(3, 500, n).tolist() for n in (9, 30)]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stream-{i}", {"prompt_token_ids": prompt}, params)
    streamed = {}
    while engine.has_unfinished_requests():
        streamed.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
    assert calls and set(calls) == {1}
    calls.clear()
    final = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(calls) == 8
    assert [o.outputs[0].token_ids for o in final] == [streamed[f"stream-{i}"] for i in range(len(prompts))]


def test_stop_strings_and_stop_tokens_end_generation(hf_model_dir, llm_factory):
    llm = llm_factory(hf_model_dir("llama"))
    tokenizer = llm.get_tokenizer()
    prompt = np.random.default_rng(9).integers(3, 500, 30).tolist()
    free = llm.generate({"prompt_token_ids": prompt}, greedy(40), use_tqdm=False)[0].outputs[0]
    stop_token = free.token_ids[10]
    by_token = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop_token)
    assert by_token.token_ids == free.token_ids[:first + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_token)
    assert by_token.text == tokenizer.decode(free.token_ids[:first])
    # vLLM: include_stop_str_in_output keeps the stop token's text, as transformers decodes the token ids.
    included = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token], include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_model_dir("llama"))
    assert included.token_ids == by_token.token_ids
    assert included.text == hf_tokenizer.decode(by_token.token_ids, skip_special_tokens=True) != by_token.text
    stop_text = free.text[len(free.text) // 2:][:3]
    assert stop_text.strip(), "the greedy text should have visible characters to stop on"
    by_string = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_text]), use_tqdm=False)[0].outputs[0]
    assert by_string.text == free.text[:free.text.index(stop_text)]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop_text)


def test_a_stop_token_sampled_as_the_last_allowed_token_finishes_with_length(hf_model_dir, llm_factory):
    """vLLM v1's check_stop tests the length before the stop tokens: a stop token sampled as the max_tokens-th
    token ends the sequence with "length", no stop_reason, and its text as transformers decodes it."""
    llm = llm_factory(hf_model_dir("llama"))
    prompt = {"prompt_token_ids": np.random.default_rng(9).integers(3, 500, 30).tolist()}
    free = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    stop_token = free.token_ids[6]
    first = free.token_ids.index(stop_token)

    def stopping_at(max_tokens: int):
        return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                   stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]

    at_limit, before_limit = stopping_at(first + 1), stopping_at(first + 2)
    assert at_limit.token_ids == before_limit.token_ids == free.token_ids[:first + 1]
    assert (at_limit.finish_reason, at_limit.stop_reason) == ("length", None)
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_model_dir("llama"))
    assert at_limit.text == hf_tokenizer.decode(free.token_ids[:first + 1], skip_special_tokens=True)
    assert (before_limit.finish_reason, before_limit.stop_reason) == ("stop", stop_token)


def test_offline_max_tokens_past_the_context_ends_at_the_context(hf_model_dir, llm_factory):
    """vLLM's offline LLM runs a request whose max_tokens passes max_model_len up to the context's end ("length");
    the engine's add_request, which the server calls, refuses it naming both lengths (vLLM's server: a 400)."""
    llm = llm_factory(hf_model_dir("llama"))  # max_model_len 512
    prompt = {"prompt_token_ids": np.random.default_rng(10).integers(3, 500, 500).tolist()}
    capped, exact = (llm.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in (greedy(50), greedy(12)))
    assert capped.token_ids == exact.token_ids and len(capped.token_ids) == 12
    assert capped.finish_reason == exact.finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length is 512 tokens. However, you requested 550 tokens "
                                         r"\(500 in the messages, 50 in the completion\)") as info:
        llm.engine.add_request("too-long", prompt, greedy(50))
    assert info.value.param == "max_tokens" and not llm.engine.has_unfinished_requests()


def test_logprobs_are_the_models_log_softmax(hf_model_dir, llm_factory, executor):
    model_dir = hf_model_dir("llama")
    llm = llm_factory(model_dir, attention_backend=executor)
    prompt = np.random.default_rng(4).integers(3, 500, 12).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                    logprobs=5), use_tqdm=False)[0].outputs[0]
    hf = load_hf(model_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, -1).numpy()
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top5 = np.argsort(-expected[position])[:5]
        assert set(entry) == {token, *top5.tolist()}
        for t, lp in entry.items():
            assert lp == pytest.approx(expected[position, t], abs=1e-4)


def test_allowed_token_ids_restrict_every_sampler_path(hf_model_dir, llm_factory, executor):
    """vLLM's allowed_token_ids: only those tokens are generated, greedy (decode bursts), sampled, under a penalty
    (single steps) and with logprobs; greedy picks transformers' argmax over the allowed tokens."""
    model_dir = hf_model_dir("llama")
    llm = llm_factory(model_dir, attention_backend=executor)
    prompt = np.random.default_rng(5).integers(3, 500, 9).tolist()
    allowed = [7, 40, 133, 300, 451]
    base = dict(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 3, [
        SamplingParams(temperature=0, **base), SamplingParams(temperature=1.0, seed=3, n=2, **base),
        SamplingParams(temperature=0.7, seed=4, presence_penalty=1.0, logprobs=1, **base)], use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            assert set(completion.token_ids) <= set(allowed)
    hf = load_hf(model_dir)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = hf(torch.tensor([tokens])).logits[0, -1]
            tokens.append(allowed[int(logits[allowed].argmax())])
    assert outputs[0].outputs[0].token_ids == tokens[len(prompt):]
    with pytest.raises(ValueError, match="outside the vocabulary") as info:
        llm.generate("x", SamplingParams(allowed_token_ids=[5, 10**6]), use_tqdm=False)
    assert info.value.param == "allowed_token_ids"
    with pytest.raises(ValueError, match="non-empty") as info:
        SamplingParams(allowed_token_ids=[])


def test_bad_words_follow_vllms_rule(hf_model_dir, llm_factory, executor):
    """vLLM's bad_words: each word is tokenized as is and, where that gives as many tokens with another first one,
    after a space; a word's last token is forbidden wherever the output ends in its other tokens (always, for a
    one-token word). Greedy tokens match transformers' under that rule; the prompt's free greedy output holds both
    words (">ang" is its tokens 32, 304), so the rule is exercised."""
    model_dir = hf_model_dir("llama")
    llm = llm_factory(model_dir, attention_backend=executor)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = [">ang", "ci"]
    encoded = [hf_tokenizer.encode(w.lstrip(), add_special_tokens=False) for w in words]
    spaced = [hf_tokenizer.encode(" " + w.lstrip(), add_special_tokens=False) for w in words]
    banned = encoded + [s for e, s in zip(encoded, spaced, strict=True) if s[0] != e[0] and len(s) == len(e)]
    prompt = np.random.default_rng(33).integers(3, 500, 7).tolist()
    free, constrained = llm.generate([{"prompt_token_ids": prompt}] * 2, [
        greedy(16), greedy(16).clone(bad_words=words)], use_tqdm=False)
    for ids in encoded:
        assert any(free.outputs[0].token_ids[i:i + len(ids)] == ids for i in range(16))
    hf = load_hf(model_dir)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            logits = hf(torch.tensor([tokens])).logits[0, -1]
            output = tokens[len(prompt):]
            for ids in banned:
                if len(ids) - 1 <= len(output) and output[len(output) - len(ids) + 1:] == ids[:-1]:
                    logits[ids[-1]] = -float("inf")
            tokens.append(int(logits.argmax()))
    assert constrained.outputs[0].token_ids == tokens[len(prompt):]
    for ids in encoded:
        assert not any(constrained.outputs[0].token_ids[i:i + len(ids)] == ids for i in range(16))


def test_use_tqdm_takes_a_progress_bar_class(hf_model_dir, llm_factory):
    """vLLM's use_tqdm may be a tqdm class: the call's progress is shown with it, one update per finished prompt."""
    from tqdm import tqdm

    bars = []

    class Recording(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, disable=True, **kwargs)
            self.updates = 0
            bars.append(self)

        def update(self, n=1):
            self.updates += n

    llm = llm_factory(hf_model_dir("llama"))
    llm.generate(["a", "b"], greedy(2), use_tqdm=Recording)
    assert [(bar.total, bar.updates) for bar in bars] == [(2, 2)]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(hf_model_dir, llm_factory):
    """vLLM's truncate_prompt_tokens=k: the request runs on the prompt's last k tokens (so a prompt longer than
    max_model_len fits), and reports those as its prompt_token_ids; -1 keeps as many as leave room for a token."""
    llm = llm_factory(hf_model_dir("llama"))
    prompt = np.random.default_rng(6).integers(3, 500, 600).tolist()  # longer than max_model_len (512)
    truncated = llm.generate({"prompt_token_ids": prompt}, greedy(5).clone(truncate_prompt_tokens=40),
                             use_tqdm=False)[0]
    alone = llm.generate({"prompt_token_ids": prompt[-40:]}, greedy(5), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompt[-40:]
    assert truncated.outputs[0].token_ids == alone.outputs[0].token_ids
    longest = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=None, truncate_prompt_tokens=-1),
                           use_tqdm=False)[0]
    assert longest.prompt_token_ids == prompt[-511:] and len(longest.outputs[0].token_ids) == 1
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_chat_takes_vllms_template_arguments(hf_model_dir, llm_factory):
    """LLM.chat's chat_template, continue_final_message, tools and chat_template_kwargs reach the template as
    transformers' apply_chat_template takes them, for each conversation of a batch."""
    model_dir = hf_model_dir("llama")
    llm = llm_factory(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    partial = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The quick"}]
    out = llm.chat(partial, greedy(2), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt_token_ids == hf_tokenizer.apply_chat_template(
        partial, tokenize=True, return_dict=False, add_generation_prompt=False, continue_final_message=True)
    assert hf_tokenizer.decode(out[0].prompt_token_ids).endswith("The quick")
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}"
                "{% if tools %}tools:{{ tools | length }}{% endif %}{{ greeting }}"
                "{% if add_generation_prompt %}[assistant|{% endif %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    outs = llm.chat([partial[:1], partial], greedy(2), use_tqdm=False, chat_template=template, tools=tools,
                    chat_template_kwargs={"greeting": "hi"})
    for conversation, output in zip([partial[:1], partial], outs, strict=True):
        assert output.prompt_token_ids == hf_tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=False, chat_template=template, tools=tools, greeting="hi",
            add_generation_prompt=True)
    assert hf_tokenizer.decode(outs[0].prompt_token_ids) == "[user|hello]tools:1hi[assistant|"


@pytest.mark.parametrize("prompt, params, param, message", [
    ([5] * 600, SamplingParams(), "prompt", "This model's maximum context length is 512 tokens. However, your "
                                            "request has 600 input tokens."),
    ([], SamplingParams(), "prompt", "empty"),
    ("", SamplingParams(), "prompt", "empty"),
    ([5, 10**6], SamplingParams(), "prompt", "outside the model.s vocabulary"),
    (3.5, SamplingParams(), "prompt", "must be a string"),
])
def test_bad_requests_raise_value_error_naming_the_parameter(hf_model_dir, llm_factory, prompt, params, param,
                                                             message):
    llm = llm_factory(hf_model_dir("llama"))
    with pytest.raises(ValueError, match=message) as info:
        llm.generate(prompt if not isinstance(prompt, list) else {"prompt_token_ids": prompt}, params,
                     use_tqdm=False)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()  # nothing half-registered


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-0.1), "temperature"),
    (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(top_k=-3), "top_k"),
    (dict(output_kind="final_only"), "output_kind"),
])
def test_bad_sampling_params_raise_value_error_naming_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_a_bad_prompt_in_a_batch_rejects_the_whole_call(hf_model_dir, llm_factory):
    llm = llm_factory(hf_model_dir("llama"))
    free_before = llm.engine.block_manager.num_free_blocks
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free_before


def test_kv_budget_too_small_for_one_request_fails_with_advice(hf_model_dir):
    from jserve import LLM

    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes to at least"):
        LLM(str(hf_model_dir("llama")), max_model_len=512, kv_cache_memory_bytes=64 << 10, warmup=False,
            compilation_cache_dir="")


def test_no_recompilation_after_warmup(hf_model_dir, executor):
    """A randomized 100-request workload (mixed lengths, sampling settings, aborts) compiles nothing new: every token
    bucket, the sampler's variants and the decode bursts were compiled at warm-up, on both executors."""
    import jax
    from jax._src import dispatch  # the event name jax reports for each XLA compilation

    from jserve import LLM

    llm = LLM(str(hf_model_dir("llama")), max_model_len=256, kv_cache_memory_bytes=1 << 20,
              max_num_batched_tokens=128, max_num_seqs=16, warmup=True, compilation_cache_dir="",
              attention_backend=executor)
    engine, rng = llm.engine, np.random.default_rng(0)
    ex, stats = engine.executor, engine.stats
    assert stats.warmup_step_shapes == len(ex.token_buckets) * len(ex.page_buckets) and stats.warmup_seconds > 0
    assert stats.warmup_burst_shapes > 0 and ex.supports_burst and len(ex.page_buckets) == 1
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT \
        else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        choices = [dict(temperature=0.0), dict(temperature=0.9, seed=1), dict(temperature=1.0, top_p=0.8),
                   dict(temperature=0.7, top_k=20), dict(temperature=1.0, min_p=0.1, seed=3),
                   dict(temperature=0.0, stop=["a", "e "])]
        pending = list(range(100))
        while pending or engine.has_unfinished_requests():
            for _ in range(int(rng.integers(0, 6))):
                if pending:
                    i = pending.pop()
                    prompt = rng.integers(3, 500, int(rng.integers(1, 200))).tolist()
                    params = SamplingParams(max_tokens=int(rng.integers(1, 256 - len(prompt))),
                                            **choices[i % len(choices)])
                    engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
            if engine.outputs.requests and rng.random() < 0.1:
                engine.abort_request(str(rng.choice(sorted(engine.outputs.requests))))
            engine.step()
    finally:
        jax.monitoring.clear_event_listeners()
    assert compiles == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_fewer_sequence_rows_than_the_smallest_token_bucket_warm_their_bursts(hf_model_dir):
    """max_num_seqs 3 puts up to 3 decoding rows in the smallest token bucket (8 tokens): warm-up compiles the
    burst of that shape, so decoding compiles nothing."""
    import jax
    from jax._src import dispatch

    from jserve import LLM

    llm = LLM(str(hf_model_dir("llama")), max_model_len=128, kv_cache_memory_bytes=1 << 20, max_num_seqs=3,
              executor="xla", compilation_cache_dir="")
    assert llm.engine.stats.warmup_burst_shapes > 0
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT else None)
    try:
        outputs = llm.generate(["def f(", "import os", "class A"], SamplingParams(max_tokens=24, temperature=0,
                                                                                 ignore_eos=True), use_tqdm=False)
    finally:
        jax.monitoring.clear_event_listeners()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [24, 24, 24]
    stats = llm.engine.stats
    assert stats.num_steps > stats.num_engine_steps and compiles == []  # bursts ran, and nothing compiled


def test_without_warmup_each_shape_compiles_once(hf_model_dir):
    """Without warm-up a shape compiles on first use, once: the prompt step after a decode burst (which returns the
    KV cache committed to its device) runs the executable compiled for the first prompt."""
    import jax
    from jax._src import dispatch

    from jserve import LLM

    llm = LLM(str(hf_model_dir("llama")), max_model_len=256, kv_cache_memory_bytes=1 << 20, warmup=False,
              compilation_cache_dir="", executor="xla", attention_backend="reference")
    rng = np.random.default_rng(2)
    llm.generate({"prompt_token_ids": rng.integers(3, 500, 40).tolist()}, greedy(12), use_tqdm=False)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT else None)
    try:
        llm.generate({"prompt_token_ids": rng.integers(3, 500, 40).tolist()}, greedy(12), use_tqdm=False)
    finally:
        jax.monitoring.clear_event_listeners()
    assert llm.engine.stats.num_steps > llm.engine.stats.num_engine_steps  # bursts ran
    assert compiles == []


def test_prompt_logprobs_match_transformers_across_prefill_chunks(hf_model_dir, llm_factory, executor):
    model_dir = hf_model_dir("llama")
    # the 90-token prompt takes three chunks
    llm = llm_factory(model_dir, max_num_batched_tokens=32, attention_backend=executor)
    prompt = np.random.default_rng(6).integers(3, 500, 90).tolist()
    llm.generate({"prompt_token_ids": prompt}, greedy(2), use_tqdm=False)  # cache the prefix: it must be ignored
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    with torch.no_grad():
        expected = torch.log_softmax(load_hf(model_dir)(torch.tensor([prompt])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[position], expected[position - 1]
        assert set(entry) == {prompt[position], *np.argsort(-row)[:3].tolist()}
        for token, lp in entry.items():
            assert lp == pytest.approx(row[token], abs=1e-4)


def test_a_bfloat16_decode_burst_reads_no_weight_outside_its_steps(hf_model_dir, llm_factory):
    """The weights of a decode burst are used only inside its loop of steps: XLA once hoisted the bfloat16 embedding
    table's bitcast to uint16 (its gather) out of the loop, copying the whole table on every call (20 ms a call for
    the 135M model, a 0-step burst included)."""
    from jserve.engine.sampler import warmup_metadata

    llm = llm_factory(hf_model_dir("llama"), dtype="bfloat16", decode_burst=4)
    executor = llm.engine.executor
    batch = next(executor.burst_batches())
    meta = warmup_metadata(len(batch.seq_lens))[0]
    hlo = executor.lower_burst(batch, meta, 4)[1].compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()[1:]
    outside = [line.strip() for line in entry
               if "%params_" in line and " tuple(" not in line and " parameter(" not in line]
    assert any(" tuple(" in line and "%params_" in line for line in entry)  # the weights do enter the loop
    assert outside == []


@pytest.mark.parametrize("kwargs", [dict(kv_cache_memory_bytes=-1), dict(kv_cache_memory_bytes=0),
                                    dict(max_model_len=0), dict(block_size=0), dict(decode_burst_ms=0),
                                    dict(kv_cache_fraction=2.0), dict(max_num_seqs=True), dict(executor="gpu")])
def test_engine_settings_are_checked_when_made(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{name} must be"):
        EngineConfig(**kwargs)


def test_start_up_pauses_the_collector_and_always_turns_it_back_on(hf_model_dir, tmp_path):
    import gc

    from jserve.engine.engine import LLMEngine

    model = str(hf_model_dir("llama"))
    collections = []
    callback = lambda phase, info: collections.append(info["generation"]) if phase == "stop" else None
    gc.callbacks.append(callback)
    try:
        LLMEngine(EngineConfig(model=model, max_model_len=256, kv_cache_memory_bytes=1 << 20, warmup=True,
                               compilation_cache_dir=""))
    finally:
        gc.callbacks.remove(callback)
    assert collections == [2]  # only the one full collection at the end: none walked the objects on the way
    assert gc.isenabled()
    with pytest.raises(ValueError):  # a failure inside the paused part
        LLMEngine(EngineConfig(model=model, max_model_len=256, kv_cache_memory_bytes=1))
    assert gc.isenabled()


def test_the_gpu_compiler_options_are_options_xla_knows():
    """The executables' GPU options are set per executable, so a misspelt name would first fail on a GPU: XLA checks
    the names on any platform."""
    import jax
    import jax.numpy as jnp

    from jserve.executors.xla import burst_compiler_options, step_compiler_options

    step, burst = step_compiler_options("gpu"), burst_compiler_options("gpu")
    assert step["xla_gpu_enable_triton_gemm"] is False and step.items() <= burst.items()
    # quantized weights: the Triton GEMM at XLA's default autotuning, which fuses the weight's convert into the dot
    q_step, q_burst = step_compiler_options("gpu", True), burst_compiler_options("gpu", True)
    assert q_step == {"xla_gpu_enable_triton_gemm": True} and q_step.items() <= q_burst.items()
    for options in (step, burst, q_step, q_burst):
        assert float(jax.jit(lambda a: a @ a, compiler_options=options)(jnp.ones((4, 4)))[0, 0]) == 4.0
    assert step_compiler_options("cpu") is None and burst_compiler_options("cpu", True) is None


def test_the_models_generation_config_gives_the_default_sampling_params(hf_model_dir, llm_factory, tmp_path):
    """vLLM's --generation-config auto: generation_config.json's temperature, top_k, repetition_penalty and
    max_new_tokens are what a request without sampling_params (or, through the server and `jserve generate`, without
    those fields) runs with; max_new_tokens also caps a request that sets no max_tokens. "vllm" turns it off."""
    import json
    import shutil

    model = tmp_path / "recommended"
    shutil.copytree(hf_model_dir("llama"), model)
    recommended = {"do_sample": True, "temperature": 0.0, "top_k": 3, "top_p": None, "repetition_penalty": 1.3,
                   "max_new_tokens": 5, "eos_token_id": 2}
    (model / "generation_config.json").write_text(json.dumps(recommended))
    llm = llm_factory(model)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.repetition_penalty) == (0.0, 3, 1.3)
    prompt = "def fibonacci(n):"
    [out] = llm.generate(prompt, use_tqdm=False)
    [want] = llm.generate(prompt, SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5),
                          use_tqdm=False)
    [plain] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids != plain.outputs[0].token_ids
    [capped] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False)
    assert len(capped.outputs[0].token_ids) == 5  # no max_tokens: the model's most, not the rest of the context
    off = llm_factory(model, generation_config="vllm").get_default_sampling_params()
    assert (off.temperature, off.top_k, off.max_tokens) == (SamplingParams().temperature, 0, 16)
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config.json: .*temperature"):
        llm_factory(model, max_num_seqs=15)
