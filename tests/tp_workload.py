"""The mixed greedy workload the tensor/data-parallel and multi-host tests run (no JAX import: safe anywhere)."""

from __future__ import annotations

import numpy as np

from jserve.sampling_params import SamplingParams

ENGINE_ARGS = dict(max_model_len=256, kv_cache_memory_bytes=2 << 20, max_num_batched_tokens=64, max_num_seqs=8,
                   warmup=False, compilation_cache_dir="", block_size=16)
OUTPUT_LENGTHS = [4, 7, 10, 13, 16, 19]


def workload() -> tuple[list[dict], list[SamplingParams]]:
    """A 1-token prompt, prompts longer than the 64-token step budget (chunked prefill), a shared prefix
    (prefix cache), and different output lengths, all greedy."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 390, 40).tolist()
    prompts = [[7], rng.integers(3, 390, 9).tolist(), rng.integers(3, 390, 150).tolist(),
               prefix + [11, 12], prefix + [13], rng.integers(3, 390, 70).tolist()]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in OUTPUT_LENGTHS]
    return [{"prompt_token_ids": p} for p in prompts], params


def greedy_tokens(llm) -> list[list[int]]:
    prompts, params = workload()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
