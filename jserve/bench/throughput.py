"""`jserve bench throughput`: offline throughput of jserve, or of transformers `generate` with static batches.

Both backends get the same requests (token ids, exact lengths) and generate greedily, ignoring EOS, exactly each
request's output length. transformers cannot stop one row of a batch early, so a static batch runs to its longest
request: only the requested tokens are counted as output, the rest is the cost of static batching. Start-up
(loading, and jserve's compile warm-up) is reported apart from the timed run.
"""

from __future__ import annotations

import dataclasses
import json
import time
from argparse import Namespace
from pathlib import Path

from jserve.bench.datasets import SampleRequest, build_requests


def model_dir(args: Namespace) -> Path:
    from jserve.engine.engine import model_path

    return model_path(args.model)


def run_jserve(args: Namespace, requests: list[SampleRequest]) -> dict:
    from jserve.engine_args import engine_config_from_args
    from jserve.llm import LLM
    from jserve.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    before = dataclasses.replace(llm.engine.stats)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats
    engine_steps = stats.num_engine_steps - before.num_engine_steps
    # The host's work in a step is its wall time less the time it waited for the device's results.
    host = (stats.step_seconds - before.step_seconds) - (stats.device_wait_seconds - before.device_wait_seconds)
    return {"backend": "jserve", "dtype": args.dtype, "startup_s": startup, "elapsed_s": elapsed,
            **warmup_report(stats),
            "output_tokens": generated, "generated_tokens": generated,
            "engine_steps": stats.num_steps - before.num_steps, "engine_calls": engine_steps,
            "host_ms_per_engine_call": 1e3 * host / max(engine_steps, 1), **speculation_report(llm.engine)}


def static_batches(requests: list[SampleRequest], batch_size: int, sort: bool) -> list[list[SampleRequest]]:
    """Consecutive batches; sorted longest first, so each batch wastes as little padding as static batching can."""
    order = sorted(requests, key=lambda r: (r.output_len, r.prompt_len), reverse=True) if sort else requests
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def run_hf(args: Namespace, requests: list[SampleRequest]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    start = time.perf_counter()
    path = model_dir(args)
    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if path.is_file() else \
        dict(pretrained_model_name_or_path=path)  # a GGUF file, transformers' own GGUF loading
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, args.hf_dtype)).eval()
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    _hf_generate(model, [SampleRequest(requests[0].prompt_token_ids[:8], 2)], pad)  # first-call overheads
    startup = time.perf_counter() - start
    batches = static_batches(requests, args.hf_batch_size, args.hf_sort)
    generated = 0
    start = time.perf_counter()
    for batch in _progress(batches, args.disable_tqdm):
        generated += _hf_generate(model, batch, pad)
    elapsed = time.perf_counter() - start
    return {"backend": "hf", "dtype": args.hf_dtype, "hf_batch_size": args.hf_batch_size, "startup_s": startup,
            "elapsed_s": elapsed, "output_tokens": sum(r.output_len for r in requests),
            "generated_tokens": generated}


def _hf_generate(model, batch: list[SampleRequest], pad: int) -> int:
    """One static batch, left-padded; min_new_tokens = max_new_tokens makes every row ignore EOS."""
    import torch

    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        mask[row, width - r.prompt_len:] = 1
    new = max(r.output_len for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=pad)
    return (out.shape[1] - width) * len(batch)


def _progress(items: list, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(items, desc="batches", disable=disable)


def summarize(run: dict, requests: list[SampleRequest]) -> dict:
    elapsed = run["elapsed_s"]
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {**run, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
            "requests_per_s": len(requests) / elapsed, "output_tokens_per_s": run["output_tokens"] / elapsed,
            "total_tokens_per_s": (prompt_tokens + run["output_tokens"]) / elapsed}


def run_throughput(args: Namespace) -> int:
    from jserve.tokenizer import load_tokenizer

    path = model_dir(args)
    tokenizer = load_tokenizer(args.tokenizer or path)
    requests = build_requests(args, tokenizer, tokenizer.special_token_ids)
    run = run_hf(args, requests) if args.backend == "hf" else run_jserve(args, requests)
    report = {"model": str(path), "dataset": args.dataset, "seed": args.seed, **summarize(run, requests)}
    print(f"Throughput ({report['backend']}, {report['dtype']}): {report['requests_per_s']:.2f} requests/s, "
          f"{report['output_tokens_per_s']:.2f} output tokens/s, {report['total_tokens_per_s']:.2f} total tokens/s "
          f"({report['num_requests']} requests, {report['prompt_tokens']} prompt + {report['output_tokens']} output "
          f"tokens in {report['elapsed_s']:.2f} s; start-up {report['startup_s']:.1f} s)")
    if "warmup_s" in report:
        print(warmup_line(report))
    if "host_ms_per_engine_call" in report:
        print(f"Host work: {report['host_ms_per_engine_call']:.3f} ms per engine step ({report['engine_calls']} "
              f"steps running {report['engine_steps']} model steps; the rest of each step waited for the device)")
    if "spec_num_drafts" in report:
        print(speculation_line(report))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def warmup_report(stats) -> dict:
    """The engine's warm-up (EngineStats), for a benchmark's JSON."""
    return {"warmup_s": stats.warmup_seconds, "warmup_step_shapes": stats.warmup_step_shapes,
            "warmup_burst_shapes": stats.warmup_burst_shapes}


def warmup_line(report: dict) -> str:
    return (f"Warm-up: {report['warmup_step_shapes']} step shapes and {report['warmup_burst_shapes']} decode bursts "
            f"compiled in {report['warmup_s']:.1f} s")


def speculation_report(engine) -> dict:
    """Speculative decoding's counters over every iteration (warm-up ones included); {} when it is off."""
    stats = engine.stats
    if engine.config.speculative_config is None:
        return {}
    return {"spec_num_drafts": stats.spec_num_drafts, "spec_num_draft_tokens": stats.spec_num_draft_tokens,
            "spec_num_accepted_tokens": stats.spec_num_accepted_tokens,
            "spec_acceptance_rate": stats.spec_acceptance_rate,
            "spec_mean_accepted_length": stats.spec_mean_accepted_length,
            "spec_accepted_per_pos": list(stats.spec_accepted_per_pos)}


def speculation_line(report: dict) -> str:
    return (f"Speculative decoding: {report['spec_num_drafts']} drafted steps, {report['spec_num_draft_tokens']} "
            f"draft tokens, acceptance {report['spec_acceptance_rate']:.1%}, mean accepted length "
            f"{report['spec_mean_accepted_length']:.2f}, accepted per position {report['spec_accepted_per_pos']}")
