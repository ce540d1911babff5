"""The jitted sampler against a NumPy reference written here (vLLM's processing order), and the sampling parameters
as users pass them (clear errors naming a bad field; NumPy token ids and dicts of fields).

Shapes are kept to a handful (V = 64, S in {1, 8, 4096}) so few variants compile on a small CPU box.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.engine.sampler import (
    GREEDY_EPS,
    MetadataCache,
    SamplerOutput,
    SamplingMetadata,
    _sort_descending,
    build_metadata,
    hash_seed,
    pow2_bucket,
    sample,
)
from jserve.engine.sequence import Sequence
from jserve.sampling_params import MAX_LOGPROBS, InvalidParameterError, SamplingParams

V = 64
EOS = 7
DRAWS = 4096


def make_seq(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
             seed: int = 0) -> Sequence:
    seq = Sequence("req", prompt if prompt is not None else [1, 2, 3], params)
    for token in output or []:
        seq.append_token(token)
    seq.sampling_seed = seed  # the engine sets this on every sequence
    return seq


def run(logits: np.ndarray, seqs: list[Sequence], pad_to: int, **kwargs) -> SamplerOutput:
    meta = build_metadata(seqs, pad_to, **kwargs)
    return jax.tree.map(np.asarray, sample(np.asarray(logits, np.float32), meta))


# ------------------------------------------------------------------------------------------ NumPy reference


def ref_processed(row: np.ndarray, seq: Sequence) -> np.ndarray:
    """Logit bias, min_tokens bans and penalties, before temperature (float64)."""
    p = seq.params
    x = row.astype(np.float64).copy()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if seq.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
        x[banned] = -np.inf
    for token in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    counts = np.bincount(np.asarray(seq.output_token_ids, np.int64), minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class AmbiguousRow(AssertionError):
    """The top-p cut falls so close to a cumulative mass that float32 rounding may move it."""


def ref_probs(row: np.ndarray, seq: Sequence) -> np.ndarray:
    """The distribution a sampled row draws from, in vLLM v1's order: processing, temperature, min-p (against the
    most likely token), top-k, then top-p over what min-p and top-k keep."""
    p = seq.params
    x = ref_processed(row, seq) / p.temperature
    order = np.argsort(-x, kind="stable")
    keep = softmax(x) >= p.min_p * softmax(x).max()
    if p.top_k:
        keep[order[p.top_k:]] = False
    probs = softmax(np.where(keep, x, -np.inf))
    if p.top_p < 1:
        cum = np.cumsum(probs[order])
        if np.min(np.abs(cum - p.top_p)) < 1e-4:
            raise AmbiguousRow(f"cumulative mass within 1e-4 of top_p {p.top_p}")
        size = int(np.searchsorted(cum, p.top_p)) + 1  # smallest prefix whose mass reaches top_p
        keep[order[size:]] = False
    return softmax(np.where(keep, x, -np.inf))


def ref_log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def assert_draws_match(draws: np.ndarray, probs: np.ndarray) -> None:
    """No excluded token is drawn, and a chi-square test (alpha 1e-3) plus a TV bound accept the histogram."""
    n = len(draws)
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, f"drew excluded tokens {np.flatnonzero(counts * (probs == 0))}"
    expected = probs * n
    big = expected >= 5  # pool the rare tokens so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    if df > 0:
        z = 3.09  # upper 1e-3 normal quantile; Wilson-Hilferty gives the chi-square quantile from it
        critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical:.1f} (df {df})"
    tv = 0.5 * np.abs(counts / n - probs).sum()
    expected_tv = 0.5 * np.sum(np.sqrt(2 * probs * (1 - probs) / (math.pi * n)))
    assert tv < 3 * expected_tv + 1e-3, f"total variation {tv:.3f}"


def random_logits(rng: np.random.Generator, rows: int, scale: float = 2.0) -> np.ndarray:
    return (rng.standard_normal((rows, V)) * scale).astype(np.float32)


# ----------------------------------------------------------------------------------------------- greedy


def test_greedy_is_numpy_argmax_and_padding_is_ignored() -> None:
    logits = random_logits(np.random.default_rng(0), 8)
    seqs = [make_seq(SamplingParams(temperature=0.0)) for _ in range(5)]
    out = run(logits, seqs, 8)
    np.testing.assert_array_equal(out.token_ids[:5], logits[:5].argmax(-1))
    assert out.token_ids.dtype == np.int32
    assert out.top_ids.shape == (8, 0) and out.top_logprobs.shape == (8, 0)


def random_penalty_seq(rng: np.random.Generator) -> Sequence:
    biased = rng.choice(V, rng.integers(4), replace=False)
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=float(rng.choice([1.0, rng.uniform(0.5, 3.0)])),
        presence_penalty=float(rng.choice([0.0, rng.uniform(-2, 2)])),
        frequency_penalty=float(rng.choice([0.0, rng.uniform(-2, 2)])),
        logit_bias={int(t): float(rng.uniform(-10, 10)) for t in biased},
    )
    prompt = rng.integers(0, V, rng.integers(1, 30)).tolist()
    output = rng.integers(0, V, rng.integers(0, 30)).tolist()
    return make_seq(params, prompt, output)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_greedy_with_bias_and_penalties_matches_numpy(data_seed: int) -> None:
    rng = np.random.default_rng(data_seed)
    logits = random_logits(rng, 8)
    seqs = [random_penalty_seq(rng) for _ in range(8)]
    seqs[0].params.repetition_penalty = 1.1  # a penalty over a non-empty prompt: the history is always built
    out = run(logits, seqs, 8, history_bucket=lambda width: 64)
    for row, seq, token in zip(logits, seqs, out.token_ids, strict=True):
        ref = ref_processed(row, seq)
        assert ref[token] >= ref.max() - 1e-4, (token, int(ref.argmax()))  # equal up to float32 near-ties


def test_presence_and_frequency_count_output_tokens_only() -> None:
    logits = np.zeros((8, V), np.float32)
    logits[:, 5] = 1.0  # token 5 is the argmax and appears in every prompt
    logits[:, 6] = 0.9
    greedy = SamplingParams(temperature=0.0)
    seqs = [
        make_seq(greedy.clone(presence_penalty=2.0), prompt=[5, 5, 5]),
        make_seq(greedy.clone(frequency_penalty=2.0), prompt=[5, 5, 5]),
        make_seq(greedy.clone(repetition_penalty=2.0), prompt=[5, 5, 5]),  # 1.0 -> 0.5
        make_seq(greedy.clone(presence_penalty=0.2), prompt=[1], output=[5]),  # 0.8 < 0.9
        make_seq(greedy.clone(frequency_penalty=0.05), prompt=[1], output=[5, 5, 5]),  # 0.85 < 0.9
        make_seq(greedy.clone(repetition_penalty=1.2), prompt=[1], output=[5]),
        make_seq(greedy.clone(presence_penalty=2.0, repetition_penalty=2.0), prompt=[6, 5]),  # 0.5 > 0.45
    ]
    out = run(logits, seqs, 8, history_bucket=lambda width: 64)
    np.testing.assert_array_equal(out.token_ids[:7], [5, 5, 6, 6, 6, 6, 5])


# -------------------------------------------------------------------------------------- sampled filters


FILTER_CASES = {
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=0.7, top_p=0.6),
    "min_p": dict(temperature=1.3, min_p=0.1),
    # vLLM v1 counts top-p's mass after min-p's cut: here that keeps 2 tokens, min-p after top-p would keep 4
    "min_p_then_top_p": dict(temperature=1.0, top_p=0.8, min_p=0.1),
    "all_with_bias": dict(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05, logit_bias={3: 4.0, 9: -50.0}),
}


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_filters_exclude_tokens_and_match_reference_distribution(case: str) -> None:
    row = random_logits(np.random.default_rng(1), 1)[0]
    params = SamplingParams(**FILTER_CASES[case])
    seqs = [make_seq(params, output=[2, 4], seed=seed) for seed in range(DRAWS)]
    out = run(np.broadcast_to(row, (DRAWS, V)), seqs, DRAWS)
    assert_draws_match(out.token_ids, ref_probs(row, seqs[0]))


def test_plain_sampling_with_penalties_matches_reference_distribution() -> None:
    row = random_logits(np.random.default_rng(2), 1)[0]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3)
    seqs = [make_seq(params, prompt=[0, 1, 2], output=[3, 3, 4], seed=seed) for seed in range(DRAWS)]
    out = run(np.broadcast_to(row, (DRAWS, V)), seqs, DRAWS)
    assert_draws_match(out.token_ids, ref_probs(row, seqs[0]))


def test_mixed_batch_keeps_each_rows_own_filters() -> None:
    rng = np.random.default_rng(3)
    logits = random_logits(rng, DRAWS)
    cases = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
             SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=2.0, min_p=0.3)]
    seqs = [make_seq(cases[i % 4], seed=i) for i in range(DRAWS)]
    out = run(logits, seqs, DRAWS)
    checked = 0
    for row, seq, token in zip(logits, seqs, out.token_ids, strict=True):
        if seq.params.greedy:
            assert token == row.argmax()
            continue
        try:
            probs = ref_probs(row, seq)
        except AmbiguousRow:
            continue
        assert probs[token] > 0, (seq.params, token)
        checked += 1
    assert checked > 0.7 * DRAWS


def test_descending_sort_orders_special_floats() -> None:
    values = np.array([0.5, -np.inf, -0.0, 3e38, -1e-30, np.inf, -2.5, 0.0, 1e-30, -3e38], np.float32)
    got = np.asarray(_sort_descending(values[None]))[0]
    np.testing.assert_array_equal(got, np.sort(values)[::-1])


# -------------------------------------------------------------------------------------- reproducibility


SEEDED = SamplingParams(temperature=1.0, top_k=20)  # temperature 1 so the key test can redo the draw exactly


def test_seeded_draw_is_independent_of_the_batch() -> None:
    rng = np.random.default_rng(4)
    target = SEEDED
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.3),
              SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=1.0, logprobs=3,
                             logit_bias={1: 5.0})]
    for seed in [0, 1, 12345, 2**32 - 1, -3, 2**63 + 5]:
        row = random_logits(rng, 1)
        output = rng.integers(0, V, rng.integers(0, 5)).tolist()  # the step is the number of outputs
        alone = run(row, [make_seq(target, output=output, seed=seed)], 1).token_ids[0]
        for variant in range(2):
            batch = random_logits(rng, 8)
            batch[3] = row[0]
            params = [others[(i + variant) % 3] if variant else target for i in range(7)]
            seqs = [make_seq(p, rng.integers(0, V, 4).tolist(), [5] * i, seed=int(rng.integers(2**32)))
                    for i, p in enumerate(params)]
            seqs.insert(3, make_seq(target, output=output, seed=seed))
            assert run(batch, seqs, 8).token_ids[3] == alone, (seed, variant)


def test_key_is_fold_in_of_seed_and_step() -> None:
    row = random_logits(np.random.default_rng(5), 1)
    top_k_row = np.where(row[0] >= np.sort(row[0])[-SEEDED.top_k], row[0], -np.inf)
    for seed, step in [(0, 0), (7, 3), (7, 4), (2**31 + 11, 9), (-1, 2)]:
        out = run(row, [make_seq(SEEDED, output=[0] * step, seed=seed)], 1)
        key = jax.random.fold_in(jax.random.key(np.uint32(hash_seed(seed))), step)
        assert out.token_ids[0] == jax.random.categorical(key, top_k_row)


# ------------------------------------------------------------------------------------- bias and min_tokens


def test_min_tokens_forbids_eos_and_stop_tokens_even_at_the_top() -> None:
    logits = random_logits(np.random.default_rng(6), 8)
    logits[:, EOS] = 40.0  # EOS would win every draw
    logits[:, 11] = 39.0  # then the stop token
    greedy = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[11], eos_token_ids=[EOS])
    sampled = greedy.clone(temperature=1.0, seed=0)
    seqs = [
        make_seq(greedy),
        make_seq(greedy, output=[1]),
        make_seq(greedy, output=[1, 1]),  # min_tokens reached: EOS is allowed again
        make_seq(greedy.clone(ignore_eos=True)),  # EOS does not end this request, so it is not forbidden
        *[make_seq(sampled, seed=s) for s in range(4)],
    ]
    out = run(logits, seqs, 8)
    assert out.token_ids.tolist()[:4] == [logits[0].argsort()[-3], logits[1].argsort()[-3], EOS, EOS]
    assert not set(out.token_ids[4:].tolist()) & {EOS, 11}


# ----------------------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_top_k() -> None:
    logits = random_logits(np.random.default_rng(7), 8, scale=3.0)
    seqs = [make_seq(SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 30.0})),
            make_seq(SamplingParams(temperature=1.0, top_p=0.9, seed=1, repetition_penalty=2.0), output=[4]),
            make_seq(SamplingParams(temperature=0.0))]
    out = run(logits, seqs, 8)
    assert out.top_ids.shape == (8, MAX_LOGPROBS) and out.top_logprobs.dtype == np.float32
    assert out.token_ids[0] == 0  # the bias changes the choice but not the reported logprobs
    rows = zip(logits, out.token_ids, out.top_ids, out.top_logprobs, out.logprobs, strict=True)
    for row, token, ids, values, chosen in rows:
        ref = ref_log_softmax(row)
        np.testing.assert_array_equal(ids, np.argsort(-ref, kind="stable")[:MAX_LOGPROBS])
        np.testing.assert_allclose(values, ref[ids], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(chosen, ref[token], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ build_metadata


def test_build_metadata_pads_and_sets_flags() -> None:
    warm = SamplingParams(temperature=0.7)
    seqs = [make_seq(SamplingParams(temperature=0.0, top_k=3)),
            make_seq(SamplingParams(temperature=GREEDY_EPS / 2, top_p=0.5)),  # near-zero temperature: greedy
            make_seq(warm.clone(frequency_penalty=0.1), prompt=list(range(40)), output=[1]),
            make_seq(warm.clone(repetition_penalty=1.1), prompt=list(range(20)), output=[1, 2])]
    meta = build_metadata(seqs, 8)
    assert isinstance(meta, SamplingMetadata)
    np.testing.assert_allclose(meta.temperature, [0, 0, 0.7, 0.7, 0, 0, 0, 0])
    np.testing.assert_array_equal(meta.top_k, 0)
    flags = (meta.all_greedy, meta.needs_penalties, meta.needs_filters, meta.num_logprobs)
    assert flags == (False, True, False, 0)
    # Only the repetition-penalty row carries its prompt; the frequency row keeps just its output.
    assert meta.history_ids.shape == (8, 32)
    np.testing.assert_array_equal(meta.history_ids[2, :2], [1, -1])
    np.testing.assert_array_equal(meta.history_ids[3, :23], list(range(20)) + [1, 2, -1])
    np.testing.assert_array_equal(meta.num_prompt, [0, 0, 0, 20, 0, 0, 0, 0])
    np.testing.assert_array_equal(meta.history_ids[[0, 1, 4]], -1)
    np.testing.assert_array_equal(meta.steps, [0, 0, 1, 2, 0, 0, 0, 0])
    assert meta.bias_ids.shape == (8, 0)
    dtypes = [a.dtype for a in (meta.seeds, meta.history_ids, meta.bias_values)]
    assert dtypes == [np.uint32, np.int32, np.float32]
    with pytest.raises(ValueError):
        build_metadata(seqs, 2)


def test_build_metadata_without_penalties_or_bias_has_empty_side_arrays() -> None:
    meta = build_metadata([make_seq(SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0))], 4)
    # A presence penalty with no output tokens yet has nothing to count.
    assert meta.history_ids.shape == (4, 0) and meta.bias_ids.shape == (4, 0) and not meta.needs_penalties
    assert meta.all_greedy and meta.num_logprobs == 0


@given(st.integers(-(2**63), 2**64 - 1))
def test_hash_seed_is_a_deterministic_uint32(seed: int) -> None:
    value = hash_seed(seed)
    assert 0 <= value < 2**32 and value == hash_seed(seed)
    if 0 <= seed < 2**32:
        assert value == seed


def test_buckets_are_powers_of_two() -> None:
    assert [pow2_bucket(n, 16) for n in (0, 1, 16, 17, 100)] == [0, 16, 16, 32, 128]
    assert hash_seed(-1) == hash_seed(2**64 - 1)  # the same 64 bits, read as signed or unsigned
    assert len({hash_seed(s) for s in (-1, -2, 2**32, 2**32 + 1, 2**63)}) == 5


def test_metadata_cache_gives_what_build_metadata_gives_step_after_step() -> None:
    """The cache keeps a batch's metadata across steps and replaces only the step counts; batches whose
    metadata changes otherwise (a penalty's history, a pending min_tokens) or whose sequences change are rebuilt."""
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=4, logit_bias={5: 2.0})
    waits = SamplingParams(temperature=0.5, min_tokens=2, stop_token_ids=[9])
    penalized = SamplingParams(temperature=0.7, repetition_penalty=1.2)
    a, b, c, d = (make_seq(p) for p in (greedy, seeded, waits, penalized))
    cache = MetadataCache()
    for batch, pad_to in [([a, b], 4), ([a, b], 4), ([a, b, c], 4), ([a, b, c], 4), ([a, b, c], 4), ([a, b, c], 4),
                          ([a, b, c], 8), ([a, b, c, d], 4), ([a, b, c, d], 4), ([b, a], 2)]:
        got, want = cache.build(batch, pad_to), build_metadata(batch, pad_to)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(x, y)
        for seq in batch:
            seq.append_token(11 + seq.num_output_tokens)
    assert cache.build([a, b], 4) is not cache.build([a, b], 4)  # fresh step counts every call


# ------------------------------------------------------------------------------------- parameters as users pass them


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    (dict(stop=5), "stop", "stop must be a string or a list of strings, got int"),
    (dict(stop_token_ids=7), "stop_token_ids", "stop_token_ids must be a list of token ids, got int"),
    (dict(structured_outputs={"foo": 1}), "structured_outputs",
     "unexpected keyword 'foo'; the allowed keys are json, json_object, regex, choice, grammar"),
])
def test_a_bad_field_is_an_invalid_parameter_error_naming_it(kwargs, param, message):
    with pytest.raises(InvalidParameterError, match=re.escape(message)) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_generate_takes_numpy_token_ids_and_a_dict_of_sampling_fields(hf_model_dir, llm_factory):
    llm = llm_factory(hf_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = np.array([5, 6, 7])
    for prompts in (ids, list(ids), {"prompt_token_ids": ids}, [ids, list(ids)]):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [expected] * len(outputs)
    as_dict = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    assert llm.generate([5, 6, 7], as_dict, use_tqdm=False)[0].outputs[0].token_ids == expected
    with pytest.raises(InvalidParameterError, match="unknown field.*'max_new_tokens'"):
        llm.generate([5, 6, 7], {"max_new_tokens": 4}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a dict"):
        llm.generate([5, 6, 7], 0.5, use_tqdm=False)
