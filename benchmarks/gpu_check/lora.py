"""Section lora: LoRA serving on the speed section's model (dummy weights).

A random adapter of rank 16 on every projection of every layer is written here in PEFT's file layout (peft need
not be installed), and one engine with enable_lora serves it beside the base model: batch-1 decode and offline
throughput with every request on the base model and with every request on the adapter, each measured on its
second run (the first compiles what it needs). As a check, the adapter's greedy tokens for one request served alone
must equal the same request's in a batch that mixes it with base-model requests, and must differ from the base
model's (the adapter changes what the model computes).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu_check.common import model_dir, section_args, work_dir
from benchmarks.gpu_check.speed import engine_settings, run_requests, step_split

RANK, ALPHA = 16, 32
# (module path in the decoder block, name): the projections a PEFT adapter of every target holds
TARGETS = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]


def write_adapter(cfg, out: Path, rank: int = RANK, alpha: float = ALPHA, seed: int = 0) -> Path:
    """A PEFT LoRA directory for a model of this config: A [r, in] ~ N(0, 1/in), B [out, r] ~ N(0, 0.02^2), float16."""
    from safetensors.numpy import save_file

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (hidden, cfg.q_size), "k_proj": (hidden, cfg.kv_size), "v_proj": (hidden, cfg.kv_size),
              "o_proj": (cfg.q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, name in TARGETS:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in), np.float32)
                                                  / np.sqrt(fan_in)).astype(np.float16)
            tensors[f"{prefix}.lora_B.weight"] = (0.02 * rng.standard_normal((fan_out, rank), np.float32)
                                                  ).astype(np.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": [name for _, name in TARGETS]}))
    return out


def main() -> None:
    import jax

    from jserve import LLM
    from jserve.lora_request import LoRARequest

    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    work = work_dir()
    path, load_format = model_dir(args["model"], work)
    settings = dict(engine_settings(args, load_format, on_gpu), enable_lora=True, max_lora_rank=RANK)
    results.record("settings", {**settings, "model": args["model"], "rank": RANK, "targets": [n for _, n in TARGETS]})
    start = time.perf_counter()
    llm = LLM(str(path), warmup=False, **settings)
    engine = llm.engine
    adapter = LoRARequest("random", 1, str(write_adapter(engine.model_config, work / "lora-adapter")))
    results.record("load_seconds", time.perf_counter() - start)
    rng = np.random.default_rng(0)
    vocab = min(engine.model_config.vocab_size, 32000)

    def measured(n: int, in_len: int, out_len: int, lora: LoRARequest | None) -> dict:
        _, cold = run_requests(llm, rng.integers(10, vocab, (n, in_len)).tolist(), out_len, [lora] * n)
        before = dataclasses.replace(engine.stats)
        outputs, seconds = run_requests(llm, rng.integers(10, vocab, (n, in_len)).tolist(), out_len, [lora] * n)
        entry = {"concurrent": n, "input": in_len, "output": out_len, "adapter": lora is not None,
                 "seconds": seconds, "cold_seconds": cold, **step_split(before, engine.stats)}
        if n == 1:
            m = outputs[0].metrics
            entry["tok_s"] = (out_len - 1) / (m["finished_time"] - m["first_token_time"])
        else:
            entry["output_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
        return entry

    decode_len = int(args.get("decode_tokens", 256))
    for lora in (None, adapter):
        results.append("batch1_decode", measured(1, 128, decode_len, lora))
    in_len, out_len = (int(x) for x in args["io"][0].split("/"))
    for n in (int(c) for c in args["concurrency"]):
        for lora in (None, adapter):
            results.append("throughput", measured(n, in_len, out_len, lora))
    # The check: one request on the adapter, alone and among base-model requests, and on the base model.
    prompts = rng.integers(10, vocab, (4, 32)).tolist()
    alone, _ = run_requests(llm, prompts[:1], 16, [adapter])
    mixed, _ = run_requests(llm, prompts, 16, [adapter, None, adapter, None])
    base, _ = run_requests(llm, prompts[:1], 16, [None])
    tokens = [list(o.outputs[0].token_ids) for o in (alone[0], mixed[0], base[0])]
    results.record("check", {"alone_equals_mixed": tokens[0] == tokens[1], "differs_from_base": tokens[0] != tokens[2],
                             "tokens": tokens})


if __name__ == "__main__":
    main()
