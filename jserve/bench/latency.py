"""`jserve bench latency`: batch-1 prefill and decode speed, printed beside the memory-bandwidth roofline.

Each iteration runs one request with a fresh random prompt (so the prefix cache cannot help) of --input-len
tokens and --output-len greedy tokens, EOS ignored. Prefill speed is input tokens / time to the first token;
decode speed is the remaining tokens / the time after the first token. Medians over --num-iters are reported,
after --num-iters-warmup untimed iterations.

The memory's read bandwidth is measured right before each timed iteration: on a shared machine it moves (seen
halving for minutes at a time), so each iteration's decode is set against the bandwidth of its own moment.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from argparse import Namespace
from pathlib import Path

import numpy as np

from jserve.bench.datasets import ordinary_token_ids, random_prompt
from jserve.bench.roofline import (
    decode_bytes_per_token,
    last_level_cache_bytes,
    stream_bandwidth,
    stream_buffer_bytes,
    weight_bytes_read_per_token,
)
from jserve.bench.throughput import speculation_line, speculation_report, warmup_line, warmup_report

# Bytes read per token under this multiple of the last-level cache may partly come from it. The roofline's buffer is
# that size, so the cache's part is in it, but a decode can keep more of itself there than one plain pass does (a 269
# MB model beside a 260 MiB L3 read its matmuls at 1.16-1.19x a 256 MiB read; a 588 MB one at 0.97-1.00:
# docs/benchmarks.md), and the share can then overstate.
CACHE_NOTE_MULTIPLE = 2


def time_request(engine, request_id: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(time to first token, time from first to last token) of one request run alone."""
    from jserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first = None
    while True:
        outputs = [o for o in engine.step() if o.request_id == request_id]
        now = time.perf_counter()
        if outputs and first is None and outputs[-1].outputs[0].token_ids:
            first = now
        if outputs and outputs[-1].finished:
            return first - start, now - first


def measure(args: Namespace) -> dict:
    from jserve.engine_args import engine_config_from_args
    from jserve.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    vocab = ordinary_token_ids(engine.tokenizer, engine.tokenizer.special_token_ids)
    stored = {"quantization": engine.quantization, "kv_cache_dtype": engine.config.kv_cache_dtype}
    per_token = decode_bytes_per_token(engine.model_config, args.dtype, mean_context(args.input_len, args.output_len),
                                       **stored)
    buffer = stream_buffer_bytes(per_token, last_level_cache_bytes())
    ttfts, decodes, bandwidths = [], [], []
    for i in range(args.num_iters_warmup + args.num_iters):
        timed = i >= args.num_iters_warmup
        if timed:
            bandwidths.append(stream_bandwidth(buffer))
        ttft, decode = time_request(engine, f"latency-{i}", random_prompt(rng, vocab, args.input_len),
                                    args.output_len)
        if timed:
            ttfts.append(ttft)
            decodes.append(decode)
    ttft, decode = statistics.median(ttfts), statistics.median(decodes)
    return {"ttft_s": ttft, "decode_s": decode, "prefill_tokens_per_s": args.input_len / ttft,
            "decode_tokens_per_s": (args.output_len - 1) / decode, "decode_s_each": decodes,
            "bandwidth_each": bandwidths, "stream_buffer_bytes": buffer, "model_config": engine.model_config, **stored,
            **warmup_report(engine.stats), **speculation_report(engine)}


def mean_context(input_len: int, output_len: int) -> float:
    """The mean context a decode step attends over."""
    return input_len + output_len / 2


def roofline(cfg, dtype: str, input_len: int, output_len: int, decode_s_each: list[float],
             bandwidth_each: list[float], quantization: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    """The roofline at the median of the bandwidths measured before each iteration, and the median over iterations
    of each decode's share of the roofline at its own bandwidth."""
    context = mean_context(input_len, output_len)
    per_token = decode_bytes_per_token(cfg, dtype, context, quantization, kv_cache_dtype)
    bandwidth = statistics.median(bandwidth_each)
    shares = [(output_len - 1) / seconds / (bw / per_token) for seconds, bw in zip(decode_s_each, bandwidth_each,
                                                                                     strict=True)]
    return {"stream_bandwidth_gb_s": bandwidth / 1e9, "stream_bandwidth_gb_s_each": [bw / 1e9 for bw in bandwidth_each],
            "weight_bytes_per_token": weight_bytes_read_per_token(cfg, dtype, quantization),
            "bytes_per_decode_token": per_token, "mean_context": context,
            "roofline_decode_tokens_per_s": bandwidth / per_token,
            "decode_fraction_of_roofline": statistics.median(shares),
            "last_level_cache_bytes": last_level_cache_bytes()}


def run_latency(args: Namespace) -> int:
    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2 to time decoding")
    result = measure(args)
    cfg = result.pop("model_config")
    bandwidth_each = result.pop("bandwidth_each")
    report = {"model": args.model, "dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len,
              "num_iters": args.num_iters, **result,
              **roofline(cfg, args.dtype, args.input_len, args.output_len, result["decode_s_each"], bandwidth_each,
                         result["quantization"], result["kv_cache_dtype"])}
    print(warmup_line(report))
    print(f"Prefill: {report['prefill_tokens_per_s']:.1f} tokens/s (TTFT {report['ttft_s'] * 1000:.1f} ms for "
          f"{args.input_len} tokens)")
    print(f"Decode:  {report['decode_tokens_per_s']:.1f} tokens/s at batch 1 "
          f"({report['decode_s'] / (args.output_len - 1) * 1000:.2f} ms/token)")
    print(f"Roofline: {report['roofline_decode_tokens_per_s']:.1f} tokens/s = "
          f"{report['stream_bandwidth_gb_s']:.1f} GB/s read bandwidth (median; "
          f"{min(report['stream_bandwidth_gb_s_each']):.1f}-{max(report['stream_bandwidth_gb_s_each']):.1f} before "
          f"the iterations, over {report['stream_buffer_bytes'] / (1 << 20):.0f} MiB) / "
          f"{report['bytes_per_decode_token'] / 1e6:.1f} MB per token (weights "
          f"{report['weight_bytes_per_token'] / 1e6:.1f} MB + KV at {report['mean_context']:.0f} tokens of context); "
          f"decode reaches {report['decode_fraction_of_roofline']:.0%} of it (median over the iterations, each against "
          f"the bandwidth measured before it)")
    if "spec_num_drafts" in report:
        print(speculation_line(report))
    cache = report["last_level_cache_bytes"]
    if cache and report["bytes_per_decode_token"] < CACHE_NOTE_MULTIPLE * cache:
        print(f"Note: the {report['bytes_per_decode_token'] / 1e6:.1f} MB read per token is under "
              f"{CACHE_NOTE_MULTIPLE}x this CPU's {cache / (1 << 20):.0f} MiB last-level cache: part of it may be "
              f"read from the cache; the roofline's read of as many bytes counts that part, but a decode can keep "
              f"more of itself there, and the share may then overstate")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
