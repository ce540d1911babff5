"""The benchmark harness: metrics against hand-computed values, arrivals, datasets, and the three commands run
end to end on tiny settings (bench serve against an in-process fake server and the real jserve server)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from argparse import Namespace

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from checkpoints import DEMO_MODEL_DIR
from jserve.bench.arrivals import arrival_gaps, arrival_offsets
from jserve.bench.datasets import (
    MIXED_OUTPUT_RANGE,
    MIXED_PROMPT_RANGE,
    SampleRequest,
    build_requests,
    for_server,
    mixed_requests,
    ordinary_token_ids,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from jserve.bench.metrics import (
    RequestResult,
    compute_metrics,
    output_tokens_over_time,
    parse_goodput,
    summarize,
)
from jserve.bench.roofline import (
    STREAM_BUFFER_MAX_BYTES,
    STREAM_BUFFER_MIN_BYTES,
    decode_bytes_per_token,
    kv_bytes_per_token,
    last_level_cache_bytes,
    layer_norm_params,
    stream_buffer_bytes,
    weight_bytes_read_per_token,
    weight_params_read_per_token,
)
from jserve.bench.throughput import static_batches
from jserve.cli import main
from jserve.config import ModelConfig

# ----- metrics -----


def synthetic_results() -> list[RequestResult]:
    five_tokens = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft=0.1, latency=0.5,
                                itl=[0.1, 0.1, 0.1, 0.1])
    one_token = RequestResult(prompt_len=20, success=True, output_tokens=1, ttft=0.2, latency=0.2)
    failed = RequestResult(prompt_len=30, error="HTTP 500")
    return [five_tokens, one_token, failed]


def test_metrics_from_synthetic_timings():
    m = compute_metrics(synthetic_results(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)  # the failed request counts for nothing
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["p90_ttft_ms"] == pytest.approx(190.0)  # linear interpolation between 100 and 200
    # TPOT = (500 - 100) / (5 - 1) for the 5-token request; a 1-token request has none.
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["p99_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["median_e2el_ms"] == pytest.approx(350.0)
    assert "request_goodput" not in m


def test_summarize_percentiles():
    stats = summarize([0.004, 0.001, 0.003, 0.002])
    assert stats["mean"] == pytest.approx(2.5) and stats["median"] == pytest.approx(2.5)
    assert stats["p90"] == pytest.approx(3.7) and stats["p99"] == pytest.approx(3.97)
    assert summarize([])["p99"] == 0.0


def test_goodput_counts_requests_meeting_every_slo():
    results = synthetic_results()
    assert compute_metrics(results, 2.0, parse_goodput(["ttft:150"]))["request_goodput"] == pytest.approx(0.5)
    # The 1-token request has no TPOT and passes a TPOT SLO; the 5-token one (100 ms) fails 50 ms.
    assert compute_metrics(results, 2.0, parse_goodput(["tpot:50"]))["request_goodput"] == pytest.approx(0.5)
    both = parse_goodput(["ttft:1000", "tpot:100", "e2el:500"])
    assert compute_metrics(results, 2.0, both)["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics(results, 2.0, parse_goodput(["e2el:199"]))["request_goodput"] == 0.0


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:x", "tpot:0"])
def test_goodput_rejects_malformed_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_output_tokens_over_time_spreads_tokens_over_chunks():
    r = RequestResult(prompt_len=1, success=True, output_tokens=8, chunk_times=[10.1, 10.5, 11.2, 12.9])
    assert output_tokens_over_time([r], start=10.0).tolist() == [4.0, 2.0, 2.0]


# ----- arrivals -----


def test_poisson_arrivals_have_the_requested_rate():
    gaps = arrival_gaps(np.random.default_rng(0), 20000, request_rate=4.0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    regular = arrival_gaps(np.random.default_rng(0), 20000, request_rate=2.0, burstiness=4.0)
    assert regular.mean() == pytest.approx(0.5, rel=0.03)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape k: CV 1 / sqrt(k)


def test_infinite_rate_sends_everything_at_once_and_offsets_start_at_zero():
    assert arrival_offsets(np.random.default_rng(0), 5, float("inf")).tolist() == [0.0] * 5
    offsets = arrival_offsets(np.random.default_rng(0), 50, 10.0)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    with pytest.raises(ValueError):
        arrival_gaps(np.random.default_rng(0), 3, 0.0)


# ----- datasets -----


class WordTokenizer:
    """Whitespace 'tokenizer': a token is a word; ids are words that are numbers."""

    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w) if w.isdigit() else 7 for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def test_random_lengths_follow_the_range_ratio():
    vocab = ordinary_token_ids(WordTokenizer(), special_ids=[0, 1, 2])
    exact = random_requests(np.random.default_rng(0), vocab, 20, input_len=64, output_len=16)
    assert {r.prompt_len for r in exact} == {64} and {r.output_len for r in exact} == {16}
    spread = random_requests(np.random.default_rng(0), vocab, 500, 100, 40, range_ratio=0.5)
    prompts = np.array([r.prompt_len for r in spread])
    assert prompts.min() >= 50 and prompts.max() <= 150 and abs(prompts.mean() - 100) < 5
    assert all(20 <= r.output_len <= 60 for r in spread)
    assert not {0, 1, 2} & {t for r in spread for t in r.prompt_token_ids}  # special tokens never appear


def test_mixed_workload_lengths_stay_in_range_and_are_reproducible():
    vocab = np.arange(100)
    requests = mixed_requests(np.random.default_rng(1), vocab, 256)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert MIXED_PROMPT_RANGE[0] <= min(prompts) and max(prompts) <= MIXED_PROMPT_RANGE[1]
    assert MIXED_OUTPUT_RANGE[0] <= min(outputs) and max(outputs) <= MIXED_OUTPUT_RANGE[1]
    assert np.median(prompts) < np.mean(prompts)  # log-uniform: many short prompts, a long tail
    again = mixed_requests(np.random.default_rng(1), vocab, 256)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]


def test_prefix_repetition_shares_prefixes():
    requests = prefix_repetition_requests(np.random.default_rng(0), np.arange(1000), 12, prefix_len=32,
                                          suffix_len=8, num_prefixes=3, output_len=5)
    assert {r.prompt_len for r in requests} == {40} and {r.output_len for r in requests} == {5}
    assert len({tuple(r.prompt_token_ids[:32]) for r in requests}) == 3


def test_sharegpt_file_gives_prompts_and_answer_lengths(tmp_path):
    conversation = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    data = [conversation("a b c d e", "w x y z v u"), conversation("short", "too short to time"),
            {"conversations": []}, conversation("one two three four", "1 2 3 4 5")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(np.random.default_rng(0), WordTokenizer(), path, 2)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(4, 5), (5, 6)]
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(np.random.default_rng(0), WordTokenizer(), path, 3)


def test_sharegpt_fixed_output_len_still_bounds_the_prompt(tmp_path):
    # vLLM's is_valid_sequence(prompt_len, output_len, min_len=4, max_prompt_len=1024, max_total_len=2048,
    # skip_min_output_len_check=output_len is not None): a fixed output length lifts only the answer's minimum.
    def valid(prompt_len: int, output_len: int, fixed: bool) -> bool:
        return not (prompt_len < 4 or (not fixed and output_len < 4) or prompt_len > 1024
                    or prompt_len + output_len > 2048)

    conversation = lambda n, m: {"conversations": [{"from": "human", "value": " ".join(["w"] * n)},
                                                   {"from": "gpt", "value": " ".join(["a"] * m)}]}
    shapes = [(2, 10), (5, 1), (6, 7), (1500, 10), (1000, 1040), (900, 5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([conversation(n, m) for n, m in shapes]))
    for fixed in (None, 100, 1100):
        expected = sorted(n for n, m in shapes if valid(n, fixed or m, fixed is not None))
        requests = sharegpt_requests(np.random.default_rng(0), WordTokenizer(), path, len(expected), fixed)
        assert sorted(r.prompt_len for r in requests) == expected, fixed
        assert all(r.output_len == (fixed or shapes[[n for n, _ in shapes].index(r.prompt_len)][1]) for r in requests)


def test_build_requests_and_server_prompts():
    args = Namespace(dataset="random", seed=3, num_prompts=4, random_input_len=6, random_output_len=2,
                     random_range_ratio=0.0, dataset_path=None)
    requests = build_requests(args, WordTokenizer())
    served = for_server(requests, WordTokenizer(), np.random.default_rng(0), np.arange(1000))
    assert [r.prompt_token_ids for r in served] == [r.prompt_token_ids for r in requests]
    assert all(r.prompt == " ".join(map(str, r.prompt_token_ids)) for r in served)
    with pytest.raises(ValueError, match="--dataset-path"):
        build_requests(Namespace(dataset="sharegpt", seed=0, dataset_path=None), WordTokenizer())


class PairTokenizer:
    """Digits, two to a token: decoding single-digit ids and encoding again merges neighbours."""

    vocab_size = 100

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(text[i:i + 2]) for i in range(0, len(text), 2)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(str(i) for i in ids)


def test_server_prompts_are_fitted_to_the_requested_length():
    rng = np.random.default_rng(0)
    request = SampleRequest(rng.integers(1, 10, size=12).tolist(), 3)  # 12 digits re-encode to only 6 tokens
    (served,) = for_server([request], PairTokenizer(), rng, np.arange(1, 10))
    assert served.prompt_len == 12 and PairTokenizer().encode(served.prompt) == served.prompt_token_ids
    given = SampleRequest([1], 3, prompt="123456")  # a dataset's own text is sent as it is
    assert for_server([given], PairTokenizer(), rng, np.arange(1, 10))[0].prompt_token_ids == [12, 34, 56]


# ----- roofline and static batches -----

SMOLLM_135M = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_roofline_bytes_for_the_135m_shape():
    # 134,515,008 parameters (transformers' count for this shape) + the one embedding row a token looks up.
    assert weight_params_read_per_token(SMOLLM_135M) == 134_515_008 + 576
    assert kv_bytes_per_token(SMOLLM_135M, "float32", 100) == 2 * 30 * 192 * 4 * 100
    assert decode_bytes_per_token(SMOLLM_135M, "bfloat16", 0) == (134_515_008 + 576) * 2


def test_roofline_of_a_mixture_of_experts_counts_the_experts_a_step_reaches():
    """Qwen3-30B-A3B, the GPU check's MoE shape, against its model card: 30.5B parameters, 29.9B of them outside the
    embedding table and LM head, 3.3B activated (a token's reads plus the embedding table but the row it reads; the
    card cuts each figure after one decimal); a step of many tokens reaches every expert."""
    from benchmarks.gpu_check.common import QWEN3_30B_A3B

    cfg = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    table = cfg.vocab_size * cfg.hidden_size
    billions = lambda params: int(params / 1e8) / 10  # noqa: E731
    assert billions(weight_params_read_per_token(cfg) + table - cfg.hidden_size) == 3.3
    assert billions(weight_params_read_per_token(cfg, tokens=4096) + table - cfg.hidden_size) == 30.5
    assert billions(weight_params_read_per_token(cfg, tokens=4096) - table - cfg.hidden_size) == 29.9
    # 2 tokens choosing 8 of 128 experts each reach 8 + 8 * 120/128 of them on average
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    two = weight_params_read_per_token(cfg, tokens=2) - weight_params_read_per_token(cfg)
    assert two == pytest.approx(cfg.num_layers * expert * 8 * 120 / 128)


def test_roofline_of_latent_attention_against_deepseek_v2_lites_model_card():
    """DeepSeek-V2-Lite, the GPU check's latent-attention shape: 15.7B parameters, 2.4B activated, which DeepSeek
    counts without the embedding table (a token's reads but its embedding row; cut after one decimal)."""
    from benchmarks.gpu_check.common import DEEPSEEK_V2_LITE

    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE)
    table = cfg.vocab_size * cfg.hidden_size
    billions = lambda params: int(params / 1e8) / 10  # noqa: E731
    assert billions(weight_params_read_per_token(cfg, tokens=10**6) + table - cfg.hidden_size) == 15.7
    assert billions(weight_params_read_per_token(cfg) - cfg.hidden_size) == 2.4
    assert kv_bytes_per_token(cfg, "bfloat16", 1) == 27 * 576 * 2  # the latent, once a layer


# qwen2_moe: its dense and expert layers, router and shared expert, read whole by a token choosing every expert or
# by a step of many tokens; gemma2's four norms a layer; olmoe's q/k norms over all heads; deepseek_v3: latent
# attention (low-rank queries, kv_b_proj kept in float), a float32 router with its correction bias, an ungated
# shared expert
@pytest.mark.parametrize("variant, overrides, tokens", [
    ("llama", {}, 1), ("qwen2_moe", {"num_experts_per_tok": 4}, 1), ("qwen2_moe", {}, 1000), ("gemma2", {}, 1),
    ("olmoe", {}, 1000), ("deepseek_v3", {}, 1000)])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_roofline_weight_bytes_are_the_loaded_arrays_bytes(hf_model_dir, quantization, variant, overrides, tokens):
    """The bytes a decode step reads, against the loaded model's own arrays: the same parameters, less the
    embedding table but one row (plus the table where the LM head is not tied to it), with the norms that the
    model keeps in float32 counted in bfloat16 by the roofline."""
    from jserve.loading import load_model
    from jserve.models.quantization import resident_bytes

    loaded = load_model(hf_model_dir(variant, **overrides), "bfloat16", quantization=quantization)
    cfg = loaded.config
    # norms (and qwen2_moe's q/k/v biases) in float32
    norms = cfg.num_layers * (layer_norm_params(cfg) + (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias) + cfg.hidden_size
    if cfg.moe_routing in ("sigmoid_groups", "softmax_groups"):  # routers held in float32 (and V3's router bias)
        router = cfg.num_experts * (cfg.hidden_size + (cfg.moe_routing == "sigmoid_groups"))
        norms += router * sum(cfg.layer_moe(i) for i in range(cfg.num_layers))
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
    read = weight_bytes_read_per_token(cfg, "bfloat16", quantization, tokens)
    assert read - cfg.hidden_size * 2 + table + norms * 2 == pytest.approx(resident_bytes(loaded.state), rel=1e-12)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4) * 10
    assert tokens > 1 or decode_bytes_per_token(cfg, "bfloat16", 10, quantization, "int8") == read + kv


def test_last_level_cache_is_the_largest_data_level_sysfs_lists(tmp_path):
    # The Intel Xeon's sysfs (docs/benchmarks.md): L1 data and instruction, L2, and a 260 MiB L3.
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                                 (3, "Unified", "266240K")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 266240 * 1024
    (tmp_path / "index3" / "size").write_text("garbled\n")  # an unreadable level is skipped
    assert last_level_cache_bytes(tmp_path) == 2048 * 1024
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_roofline_buffer_is_the_bytes_a_token_reads_within_bounds():
    mib = 1 << 20
    # The 135M shape in bfloat16 (~269 MB) and a 588 MB model: their own size, in whole 2 MiB pages.
    assert stream_buffer_bytes(269_031_168) == 258 * mib
    assert stream_buffer_bytes(588_000_000, 260 * mib) == 562 * mib
    assert stream_buffer_bytes(100 * mib + 1) == 102 * mib
    # A tiny model reads at least the floor; a large one at most 1 GiB, or four times a larger last-level cache.
    assert stream_buffer_bytes(1_000) == STREAM_BUFFER_MIN_BYTES
    assert stream_buffer_bytes(30e9) == STREAM_BUFFER_MAX_BYTES == 1024 * mib
    assert stream_buffer_bytes(30e9, 260 * mib) == 1040 * mib
    assert stream_buffer_bytes(30e9, 512 * mib) == 2048 * mib


def test_static_batches_sort_longest_first():
    requests = [SampleRequest([1] * p, o) for p, o in [(5, 3), (2, 9), (7, 3), (1, 1), (4, 6)]]
    batches = static_batches(requests, 2, sort=True)
    assert [[(r.prompt_len, r.output_len) for r in b] for b in batches] == [[(2, 9), (4, 6)], [(7, 3), (5, 3)],
                                                                            [(1, 1)]]
    assert [len(b) for b in static_batches(requests, 2, sort=False)] == [2, 2, 1]


# ----- offline commands on a tiny model -----

TINY_ENGINE_FLAGS = ["--no-warmup", "--compilation-cache-dir", "", "--max-model-len", "256",
                     "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]


def test_bench_throughput_jserve_and_hf_run_the_same_requests(hf_model_dir, tmp_path):
    model = str(hf_model_dir("llama"))
    # No --dataset: the --random-* flags choose the random data set, as in vLLM.
    dataset = ["--num-prompts", "5", "--random-input-len", "12", "--random-output-len", "6",
               "--random-range-ratio", "0.5", "--disable-tqdm"]
    reports = {}
    for backend, extra in [("jserve", TINY_ENGINE_FLAGS), ("hf", ["--hf-batch-size", "2"])]:
        out = tmp_path / f"{backend}.json"
        assert main(["bench", "throughput", "--backend", backend, "--model", model, *dataset, *extra,
                     "--result-json", str(out)]) == 0
        reports[backend] = json.loads(out.read_text())
    jserve, hf = reports["jserve"], reports["hf"]
    assert jserve["num_requests"] == hf["num_requests"] == 5
    assert jserve["prompt_tokens"] == hf["prompt_tokens"]
    assert jserve["output_tokens"] == hf["output_tokens"]  # every request generated exactly its length
    assert hf["generated_tokens"] >= hf["output_tokens"]  # static batches run to their longest request
    for report in (jserve, hf):
        assert report["output_tokens_per_s"] == pytest.approx(report["output_tokens"] / report["elapsed_s"])
        assert report["dataset"] == "random" and report["prompt_tokens"] <= 5 * 18
    assert "--no-warmup" in TINY_ENGINE_FLAGS and jserve["warmup_step_shapes"] == jserve["warmup_s"] == 0


@pytest.mark.parametrize(("flags", "dataset", "lengths"), [
    ([], "mixed", (1024, 128, 0.0)),
    (["--random-output-len", "7"], "random", (1024, 7, 0.0)),
    (["--dataset", "prefix-repetition"], "prefix-repetition", (1024, 128, 0.0)),
])
def test_bench_throughput_random_flags_mean_the_random_dataset(flags, dataset, lengths):
    """vLLM's `bench throughput` reads the random data set whenever no other is named; jserve's default (mixed)
    yields to --random-* flags the same way."""
    from jserve.bench.cli import resolve_dataset_args
    from jserve.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", *flags])
    resolve_dataset_args(args)
    assert args.dataset == dataset
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == lengths


def test_random_flags_beside_another_dataset_are_refused_before_the_model_loads(capsys):
    assert main(["bench", "throughput", "--model", "/nonexistent", "--dataset", "mixed",
                 "--random-input-len", "8"]) == 2
    assert "--random-input-len applies to --dataset random only, not --dataset mixed" in capsys.readouterr().err


def test_hf_static_batch_ignores_eos(hf_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from jserve.bench.throughput import _hf_generate

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir("llama"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = list(range(256))  # half the vocabulary ends a plain generate()
    batch = [SampleRequest([5, 6, 7], 4), SampleRequest([8], 7)]
    with torch.no_grad():
        assert _hf_generate(model, batch, pad=0) == 2 * 7


def test_bench_latency_reports_speed_and_roofline(hf_model_dir, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(hf_model_dir("llama")), "--input-len", "8", "--output-len",
                 "4", "--num-iters", "2", "--num-iters-warmup", "1", *TINY_ENGINE_FLAGS,
                 "--result-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prefill_tokens_per_s"] > 0 and report["decode_tokens_per_s"] > 0
    assert report["warmup_step_shapes"] == 0 and report["warmup_burst_shapes"] == 0  # --no-warmup
    cfg = ModelConfig.from_pretrained(hf_model_dir("llama"))
    assert report["bytes_per_decode_token"] == decode_bytes_per_token(cfg, "float32", 8 + 4 / 2)
    assert report["roofline_decode_tokens_per_s"] == pytest.approx(
        report["stream_bandwidth_gb_s"] * 1e9 / report["bytes_per_decode_token"])
    # The bandwidth is measured before each timed iteration, and each decode is set against its own.
    bandwidths, decodes = report["stream_bandwidth_gb_s_each"], report["decode_s_each"]
    assert len(bandwidths) == len(decodes) == 2 and min(bandwidths) > 0
    assert report["stream_bandwidth_gb_s"] == pytest.approx(statistics.median(bandwidths))
    roofline_each = [bw * 1e9 / report["bytes_per_decode_token"] for bw in bandwidths]
    shares = [3 / seconds / roofline for seconds, roofline in zip(decodes, roofline_each, strict=True)]
    assert report["decode_fraction_of_roofline"] == pytest.approx(statistics.median(shares))
    assert report["last_level_cache_bytes"] == last_level_cache_bytes()
    # The bandwidth is read over a buffer of the bytes a token reads (here the floor: the model is tiny).
    assert report["stream_buffer_bytes"] == stream_buffer_bytes(report["bytes_per_decode_token"],
                                                                last_level_cache_bytes())


# ----- bench serve against a fake OpenAI-compatible server -----

FAKE_TTFT_S = 0.05
FAKE_TOKEN_S = 0.01


class FakeServer:
    """Streams max_tokens one-word chunks after FAKE_TTFT_S, FAKE_TOKEN_S apart, then a usage chunk."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.fail_odd = False  # odd-numbered requests (the first is 0) fail in-band after their first chunk
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = Starlette(routes=[Route("/v1/completions", self.generate, methods=["POST"]),
                                     Route("/v1/chat/completions", self.generate, methods=["POST"]),
                                     Route("/v1/models", self.models)])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        fail = self.fail_odd and len(self.bodies) % 2 == 0
        return StreamingResponse(self.stream(body["max_tokens"], chat, fail), media_type="text/event-stream")

    async def stream(self, n: int, chat: bool, fail: bool = False):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(FAKE_TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(FAKE_TOKEN_S)
                choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if fail:  # what jserve's routes send when a request fails after its stream began
                    error = {"message": "engine died", "type": "service_unavailable", "code": 503}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake_server():
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    server.should_exit = True
    thread.join(timeout=10)


def test_bench_serve_end_to_end_against_a_fake_server(fake_server, tmp_path):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    args = ["bench", "serve", "--base-url", fake_server.url, "--tokenizer", str(DEMO_MODEL_DIR), "--dataset",
            "random", "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "5",
            "--random-range-ratio", "0.5", "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm",
            "--goodput", "ttft:10000", "tpot:10000", "--result-json", str(out)]
    has_matplotlib = _has_matplotlib()
    assert main(args + (["--plot", str(plot)] if has_matplotlib else [])) == 0
    # Strict JSON (RFC 8259, what jq and JSON.parse read): no Infinity or NaN, so the default unlimited
    # --request-rate is written as vLLM writes it, "inf".
    report = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert report["request_rate"] == "inf"
    timed = fake_server.bodies[1:]  # the first body is the test request sent before timing starts
    assert report["model"] == "fake-model"  # discovered from /v1/models
    assert (report["completed"], report["failed"]) == (6, 0)
    assert sorted(report["output_lens"]) == sorted(b["max_tokens"] for b in timed)
    assert report["total_output_tokens"] == sum(b["max_tokens"] for b in timed)
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"]["include_usage"] for b in timed)
    assert fake_server.max_in_flight <= 2
    assert min(report["ttfts"]) >= FAKE_TTFT_S  # the server waits that long before its first chunk
    assert report["mean_tpot_ms"] >= FAKE_TOKEN_S * 1000 * 0.5
    assert len(report["itls"][0]) == report["output_lens"][0] - 1  # one gap between each pair of chunks
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert report["output_throughput"] == pytest.approx(report["total_output_tokens"] / report["duration"])
    if has_matplotlib:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_chat_endpoint_with_a_request_rate(fake_server, tmp_path):
    out = tmp_path / "chat.json"
    assert main(["bench", "serve", "--base-url", fake_server.url, "--endpoint", "/v1/chat/completions",
                 "--model", str(DEMO_MODEL_DIR), "--served-model-name", "fake-model", "--dataset",
                 "prefix-repetition", "--num-prompts", "4", "--prefix-repetition-prefix-len", "8",
                 "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
                 "--prefix-repetition-output-len", "3", "--request-rate", "50", "--disable-tqdm",
                 "--result-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["output_lens"] == [3, 3, 3, 3]
    assert all("messages" in b and b["model"] == "fake-model" and "ignore_eos" not in b for b in fake_server.bodies)
    starts = report["start_times"]
    assert starts == sorted(starts) and starts[-1] > 0  # Poisson gaps, not all at once


def test_bench_serve_reports_a_dead_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer",
                 str(DEMO_MODEL_DIR), "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                 "--disable-tqdm"]) == 2


def test_bench_serve_counts_a_stream_that_fails_in_band_as_failed(fake_server, tmp_path):
    # A 200 stream that carries some text and then an error event (OpenAI's {"error": {...}} shape) did not
    # complete: it is a failed request, with the server's message, and the run exits 1.
    fake_server.fail_odd = True
    out = tmp_path / "failed.json"
    assert main(["bench", "serve", "--base-url", fake_server.url, "--tokenizer", str(DEMO_MODEL_DIR),
                 "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3", "--max-concurrency", "1",
                 "--disable-tqdm", "--result-json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (2, 2)
    assert sum("engine died" in e for e in report["errors"]) == 2
    assert report["total_output_tokens"] == 6  # only the completed requests' tokens count


def test_bench_serve_plot_without_matplotlib_is_refused_before_any_request(fake_server, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    assert main(["bench", "serve", "--base-url", fake_server.url, "--tokenizer", str(DEMO_MODEL_DIR),
                 "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm",
                 "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert fake_server.bodies == []  # no benchmark ran only to lose its report at the end


def test_bench_serve_discovering_the_model_of_a_dead_server_is_one_line(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    # No --model: the model is asked of GET /v1/models first.
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(DEMO_MODEL_DIR),
                 "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err


def test_bench_serve_model_discovery_reports_a_refused_key():
    import httpx

    from jserve.bench.serve import discover_model

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "invalid API key"}})

    async def discover():
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await discover_model(client, "http://server", {})

    with pytest.raises(ValueError, match="401.*invalid API key.*--api-key"):
        asyncio.run(discover())


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ----- bench serve against the real jserve server -----


def test_bench_serve_against_jserve(hf_model_dir, tmp_path):
    from server_helpers import TEST_ENGINE_ARGS, ServerThread

    from jserve.config import EngineConfig
    from jserve.server.settings import ServerSettings

    model = hf_model_dir("llama")
    server = ServerThread(EngineConfig(model=str(model), **TEST_ENGINE_ARGS), ServerSettings()).start()
    try:
        out = tmp_path / "jserve.json"
        assert main(["bench", "serve", "--base-url", server.url, "--model", str(model), "--dataset", "random",
                     "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
                     "--ignore-eos", "--max-concurrency", "4", "--disable-tqdm", "--result-json", str(out)]) == 0
        # The structured-output workload: each request asks for JSON of bench.serve.BENCH_SCHEMA.
        constrained = tmp_path / "json-schema.json"
        assert main(["bench", "serve", "--base-url", server.url, "--model", str(model), "--dataset", "random",
                     "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "8",
                     "--structured-output", "json-schema", "--max-concurrency", "4", "--disable-tqdm",
                     "--result-json", str(constrained)]) == 0
        assert server.state.engine.engine.stats.grammar_mask_seconds > 0
    finally:
        server.stop()
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (4, 0)
    assert report["output_lens"] == [4, 4, 4, 4]  # usage.completion_tokens, with EOS ignored
    assert report["mean_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0
    assert (json.loads(constrained.read_text())["completed"], json.loads(constrained.read_text())["failed"]) == (4, 0)


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--num-prompts", "0"], "--num-prompts: must be at least 1, got 0"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency: must be at least 1"),
    (["serve", "--request-rate", "-2"], "--request-rate: must be positive"),
    (["serve", "--burstiness", "nan"], "--burstiness: must be positive"),
    (["serve", "--random-range-ratio", "1.5"], "--random-range-ratio: must be in [0, 1)"),
    (["serve", "--random-output-len", "0"], "--random-output-len: must be at least 1"),
    (["serve", "--plot", "/nonexistent-folder/cdf.png"], "--plot: the folder /nonexistent-folder does not exist"),
    (["throughput", "--num-prompts", "-1"], "--num-prompts: must be at least 1, got -1"),
    (["throughput", "--hf-batch-size", "0"], "--hf-batch-size: must be at least 1"),
    (["latency", "--output-len", "1"], "--output-len: must be at least 2"),
    (["latency", "--num-iters", "many"], "--num-iters: expected an integer, got 'many'"),
])
def test_bench_flags_are_checked_before_anything_runs(argv, message, tmp_path, capsys):
    # A bad count or an unwritable output used to surface as a traceback, a hang (no request may ever be in flight)
    # or an error after the whole run; each is now refused when the command line is parsed.
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv, "--model", str(tmp_path / "never-loaded")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_result_json_must_be_a_writable_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--result-json", str(tmp_path)])
    assert "is a directory, not a file" in capsys.readouterr().err


def test_bench_serve_builds_prompts_with_a_gguf_files_tokenizer(fake_server, hf_model_dir, tmp_path):
    """A GGUF file is a tokenizer too (the default model is one): its prompts have the lengths asked for."""
    from gguf_files import write_gguf

    gguf = write_gguf(hf_model_dir("llama"), tmp_path / "tiny.gguf")
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--base-url", fake_server.url, "--tokenizer", str(gguf), "--dataset", "random",
            "--num-prompts", "2", "--random-input-len", "12", "--random-output-len", "3", "--random-range-ratio",
            "0", "--ignore-eos", "--disable-tqdm", "--result-json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 2 and report["input_lens"] == [12, 12]
