"""Multi-device checks for tests/test_sharding.py, run in a subprocess that has 8 CPU devices.

XLA_FLAGS must be set before JAX starts, and the main test process has one device, so test_sharding.py runs
`python tests/sharding_worker.py SPEC_JSON` and reads one JSON object from the last line of stdout. Every
comparison is against TP = 1 computed here too, in the same process.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tp_workload import ENGINE_ARGS, greedy_tokens, workload  # noqa: E402

from jserve import LLM  # noqa: E402
from jserve.engine.packing import pack  # noqa: E402
from jserve.engine.sequence import ScheduledSeq, Sequence  # noqa: E402
from jserve.executors import CpuLayerExecutor, XlaExecutor  # noqa: E402
from jserve.loading import load_model  # noqa: E402
from jserve.lora import LoRARequest, load_adapter  # noqa: E402
from jserve.sampling_params import SamplingParams  # noqa: E402
from sharding import KV_CACHE_AXES, MODEL_AXIS, logical_spec, make_mesh  # noqa: E402


def two_step_logits(model_dir: str, tp: int, backend: str = "reference", lora: str | None = None) -> np.ndarray:
    """All-token float32 logits of a ragged batch run as two chunks per prompt (the second reads cached KV).
    lora: a PEFT adapter directory that every other prompt runs with (in the second of two slots)."""
    mesh = make_mesh(tp) if tp > 1 else None
    executor = CpuLayerExecutor if backend == "cpu" else XlaExecutor
    model = executor.load(model_dir, dtype="float32", attention_backend=backend, mesh=mesh,
                          lora=(2, 8) if lora else (0, 0))
    runner = executor(model, dtype="float32", num_blocks=32, block_size=16, max_num_batched_tokens=128,
                      max_num_seqs=8, max_model_len=256, mesh=mesh)
    if lora:
        runner.set_lora(1, load_adapter(LoRARequest("tp", 1, lora), model.config, 8))
    rng = np.random.default_rng(0)
    seqs, next_block = [], 0
    for i, n in enumerate((5, 37, 20, 1)):
        seq = Sequence("tp", rng.integers(3, 390, n).tolist(), SamplingParams())
        seq.lora_slot = 1 if lora and i % 2 == 0 else -1
        seq.block_table = list(range(next_block, next_block + 3))[::-1]  # pages out of order on purpose
        next_block += 3
        seqs.append(seq)
    out = []
    for first in (True, False):
        chunks = []
        for seq in seqs:
            half = (seq.num_prompt_tokens + 1) // 2
            n = half if first else seq.num_prompt_tokens - half
            if n:
                chunks.append(ScheduledSeq(seq, n, True))
        batch = runner.prepare(chunks, all_logits=True)
        num_tokens = sum(c.num_new_tokens for c in chunks)
        out.append(np.asarray(runner.run(batch), np.float32)[:num_tokens])
        for c in chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
    return np.concatenate(out)


def greedy_run(model_dir: str, tp: int, dp: int = 1, draft: str | None = None) -> list[list[int]]:
    """draft: speculate with this draft model (on the same mesh), and check that its drafts were accepted."""
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3} if draft else None
    llm = LLM(model_dir, tensor_parallel_size=tp, data_parallel_size=dp, speculative_config=spec, **ENGINE_ARGS)
    tokens = greedy_tokens(llm)
    if dp > 1:  # every replica must have served requests, or DP proved nothing
        assert all(e.stats.num_generated_tokens > 0 for e in llm.engine.replicas), "a replica sat idle"
    if draft:  # the model drafting for itself under TP: every draft accepted
        stats = llm.engine.stats
        assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, stats
    return tokens


def data_parallel_lora_run(model_dir: str, adapter: str) -> list[list[int]]:
    """The workload on 2 data-parallel replicas with an adapter added up front (LLMEngine.add_lora: read once,
    kept by each replica) on every other prompt; then removed."""
    llm = LLM(model_dir, data_parallel_size=2, enable_lora=True, max_lora_rank=8, **ENGINE_ARGS)
    lora = LoRARequest("dp", 1, adapter)
    assert llm.engine.add_lora(lora) and llm.engine.list_loras() == {1}
    prompts, params = workload()
    outputs = llm.generate(prompts, params, lora_request=[lora if i % 2 == 0 else None for i in range(len(prompts))],
                           use_tqdm=False)
    assert all(e.stats.num_generated_tokens > 0 for e in llm.engine.replicas), "a replica sat idle"
    assert llm.engine.remove_lora(1) and llm.engine.list_loras() == set()
    return [o.outputs[0].token_ids for o in outputs]


def sharding_report(model_dir: str, tp: int) -> dict:
    """Each parameter's and KV array's sharding against the rules table, and the bytes each device holds."""
    mesh = make_mesh(tp)
    model = load_model(model_dir, "float32", "reference", mesh=mesh)
    mismatches, sharded_total, per_device = [], 0, {d.id: 0 for d in mesh.devices.flat}
    for path, var in nnx.to_flat_state(model.state):
        array, axes = var[...], var.get_metadata()["logical_axes"]
        expected = logical_spec(axes, array.shape, mesh)
        if array.sharding.spec != expected or array.sharding.mesh.shape != mesh.shape:
            mismatches.append(f"{path}: {array.sharding.spec} != {expected}")
        if MODEL_AXIS in expected:
            sharded_total += array.nbytes
            for shard in array.addressable_shards:
                per_device[shard.device.id] += shard.data.nbytes
    runner = XlaExecutor(model, dtype="float32", num_blocks=8, block_size=16, max_num_batched_tokens=64,
                         max_num_seqs=8, max_model_len=128, mesh=mesh)
    cache = runner.kv_cache.k[0]
    kv_fraction = [s.data.nbytes / cache.nbytes for s in cache.addressable_shards]
    if cache.sharding.spec != logical_spec(KV_CACHE_AXES, cache.shape, mesh):
        mismatches.append(f"kv cache: {cache.sharding.spec}")
    return dict(mismatches=mismatches, fractions=[b / sharded_total for b in per_device.values()],
                kv_fractions=kv_fraction, kv_heads=int(cache.shape[2]))


def tpu_export(model_dir: str, tp: int) -> dict:
    """Lower the TP step with the Mosaic (TPU) attention kernel for TPU from this CPU host (jax.export)."""
    from pallas_kernels import interface

    mesh = make_mesh(tp)
    runner = XlaExecutor(load_model(model_dir, "bfloat16", "pallas", mesh=mesh), dtype="bfloat16", num_blocks=8,
                         block_size=16, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, mesh=mesh)
    seq = Sequence("tp", [5, 6, 7], SamplingParams())
    seq.block_table = [1]
    batch = runner.prepare([ScheduledSeq(seq, 3, True)])
    platform = interface.jax.default_backend
    interface.jax.default_backend = lambda: "tpu"  # "pallas" picks the kernel of the platform it believes it is on
    try:
        packed, layout = pack(batch)
        text = jax.export.export(runner._step, platforms=["tpu"])(runner.params, runner.kv_cache, packed,
                                                                  layout).mlir_module()
    finally:
        interface.jax.default_backend = platform
    return {"mosaic_kernel": "tpu_custom_call" in text, "per_device_shard_map": "manual_computation" in text}


def main(spec: dict) -> dict:
    result: dict = {"devices": jax.device_count()}
    bases = {}  # each model's TP = 1 logits
    for name, model_dir in spec.get("logits", {}).items():
        base = bases[model_dir] = two_step_logits(model_dir, 1)
        result[f"logits/{name}"] = {tp: float(np.abs(two_step_logits(model_dir, tp) - base).max())
                                    for tp in spec["tp"][name]}
    for name, (model_dir, adapter, tps) in spec.get("lora", {}).items():  # fused B rows laid out per device
        base = two_step_logits(model_dir, 1, lora=adapter)
        result[f"lora/{name}"] = {tp: float(np.abs(two_step_logits(model_dir, tp, lora=adapter) - base).max())
                                  for tp in tps}
    if "kernel_model" in spec:  # the Pallas kernel (interpreted) inside shard_map, against TP = 1 reference
        base = bases.get(spec["kernel_model"])
        base = two_step_logits(spec["kernel_model"], 1) if base is None else base
        result["logits/pallas-interpret"] = {
            tp: float(np.abs(two_step_logits(spec["kernel_model"], tp, "pallas-interpret") - base).max())
            for tp in spec["kernel_tp"]}
        result["tpu_export"] = tpu_export(spec["kernel_model"], max(spec["kernel_tp"]))
    if "sinks_model" in spec:  # attention sinks split over the devices' heads with the kernel's shard_map
        model_dir, tp = spec["sinks_model"], spec["sinks_tp"]
        base = bases.get(model_dir)
        base = two_step_logits(model_dir, 1) if base is None else base
        result["logits/pallas-interpret-sinks"] = {
            tp: float(np.abs(two_step_logits(model_dir, tp, "pallas-interpret") - base).max())}
    if "greedy" in spec:
        model_dir = spec["greedy"]
        base = greedy_run(model_dir, 1)
        runs = {f"tp{tp}": greedy_run(model_dir, tp) for tp in spec["greedy_tp"]}
        if spec.get("dp"):
            runs["dp2xtp2"] = greedy_run(model_dir, 2, dp=2)
        if spec.get("draft"):
            runs["tp2-draft"] = greedy_run(model_dir, 2, draft=model_dir)
        if spec.get("dp_lora"):
            result["dp_lora"] = data_parallel_lora_run(model_dir, spec["dp_lora"])
        result["greedy"] = {label: tokens == base for label, tokens in runs.items()}
        result["greedy_lengths"] = [len(t) for t in base]
    for tp in spec.get("sharding_tp", []):
        result[f"sharding/tp{tp}"] = sharding_report(spec["sharding_model"], tp)
    return result


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
