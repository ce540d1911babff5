"""Tensor and data parallelism: the rules table, the fused-weight layout, and (in a subprocess with 8 CPU devices)
TP = 2/4/8 and DP = 2 x TP = 2 against TP = 1."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_lora import make_adapter
from test_parity import hf_greedy
from tp_workload import ENGINE_ARGS, OUTPUT_LENGTHS, greedy_tokens, workload

from checkpoints.safetensors_loader import ParamSource, fused_row_map
from jserve.config import ModelConfig
from jserve.models.sharded_config import shard_model_config
from sharding import KV_CACHE_AXES, logical_spec

REPO = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=8, num_kv_heads=2, head_dim=8)


def test_rules_table_splits_megatron_style():
    assert logical_spec(("qkv", "embed")) == P("model", None)  # column-parallel: split output rows
    assert logical_spec(("mlp", "embed")) == P("model", None)
    assert logical_spec(("embed", "heads")) == P(None, "model")  # row-parallel: split input columns
    assert logical_spec(("embed", "mlp")) == P(None, "model")
    assert logical_spec(("vocab", "embed")) == P("model", None)
    assert logical_spec(("norm",)) == P(None)
    assert logical_spec(KV_CACHE_AXES) == P(None, None, "model", None)


def test_undividable_dimension_stays_whole():
    mesh = SimpleNamespace(shape={"model": 4, "data": 2})  # logical_spec only reads the axis sizes
    assert logical_spec(("vocab", "embed"), (512, 64), mesh) == P("model", None)
    assert logical_spec(("vocab", "embed"), (510, 64), mesh) == P(None, None)  # 510 rows do not split 4 ways
    rules = {"vocab": "data", "embed": "data"}
    assert logical_spec(("vocab", "embed"), (4, 4), rules=rules) == P("data", None)  # one mesh axis per array


def test_kv_heads_replicated_when_tp_exceeds_them():
    assert shard_model_config(CONFIG, 1) is CONFIG
    two = shard_model_config(CONFIG, 2)
    assert (two.num_kv_heads, two.kv_head_replicas, two.fused_shards) == (2, 1, 2)
    eight = shard_model_config(CONFIG, 8)
    assert (eight.num_kv_heads, eight.kv_head_replicas, eight.fused_shards) == (8, 4, 8)
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_model_config(CONFIG, 16)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_model_config(dataclasses.replace(CONFIG, num_kv_heads=3, num_heads=12), 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_block_holds_its_own_heads(tp):
    """Row block s of the fused matrix is [q | k | v] of exactly the heads device s computes."""
    cfg = shard_model_config(CONFIG, tp)
    d, reps = cfg.head_dim, cfg.kv_head_replicas
    q = np.arange(cfg.q_size)[:, None] * 1.0
    kv_rows = cfg.kv_size // reps
    source = ParamSource((cfg.q_size + 2 * cfg.kv_size, 1), np.float32)
    source.parts = {"q_proj": q, "k_proj": 1000 + np.arange(kv_rows)[:, None] * 1.0,
                    "v_proj": 2000 + np.arange(kv_rows)[:, None] * 1.0}
    source.row_map = fused_row_map(cfg, "qkv_proj", cfg.q_size + 2 * cfg.kv_size)
    full = source.read()[:, 0]
    heads, kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
    for s, block in enumerate(np.split(full, tp)):
        q_heads = np.unique(block[block < 1000] // d)
        k_heads = np.unique((block[(block >= 1000) & (block < 2000)] - 1000) // d)
        assert list(q_heads) == list(range(s * heads, (s + 1) * heads))
        # query head h reads KV head h // (num_heads // checkpoint KV heads): the copy on this device
        assert list(k_heads) == sorted({h // (CONFIG.num_heads // CONFIG.num_kv_heads) for h in q_heads})
        assert len(block[block >= 2000]) == kv_heads * d
        np.testing.assert_array_equal(source.read((slice(s * len(block), (s + 1) * len(block)),))[:, 0], block)


@pytest.fixture(scope="module")
def multi_device(hf_model_dir, tmp_path_factory):
    """Run every multi-device check once, in a subprocess with 8 CPU devices (XLA_FLAGS must precede JAX)."""
    adapters = {}  # directory -> its PEFT model

    def adapter(model_dir, **settings) -> str:
        out = tmp_path_factory.mktemp("lora")
        adapters[str(out)] = make_adapter(model_dir, out, **settings)
        return str(out)

    llama8 = str(hf_model_dir("llama", num_attention_heads=8))  # 8 heads, 2 KV heads: TP 8 replicates KV heads
    # phi3 at TP 4: its fused checkpoint tensors split and laid out per device, its 2 KV heads replicated; gemma3 at
    # TP 2: layers with their own windows and rotary bases, sandwich norms; qwen2_moe at TP 2: every expert's columns
    # and the shared expert's fused gate|up split between the devices; olmo2 at TP 2: q/k norms over heads that
    # live on two devices; gpt_oss at TP 2 on the Pallas kernel: each device's heads with their attention sinks;
    # deepseek_v3 at TP 4: one query head a device, each keeping its own copy of the latent cache
    gpt_oss = str(hf_model_dir("gpt_oss"))
    spec = {"logits": {"llama8": llama8, "qwen2": str(hf_model_dir("qwen2")),
                       "phi3": str(hf_model_dir("phi3")), "gemma3": str(hf_model_dir("gemma3")),
                       "qwen2_moe": str(hf_model_dir("qwen2_moe")), "olmo2": str(hf_model_dir("olmo2")),
                       "deepseek_v3": str(hf_model_dir("deepseek_v3"))},
            "tp": {"llama8": [2, 8], "qwen2": [4], "phi3": [4], "gemma3": [2], "qwen2_moe": [2], "olmo2": [2],
                   "deepseek_v3": [4]},
            "kernel_model": llama8, "kernel_tp": [8], "sinks_model": gpt_oss, "sinks_tp": 2,
            "greedy": llama8, "greedy_tp": [2, 8], "dp": True, "draft": True,
            "sharding_model": llama8, "sharding_tp": [2, 4, 8],
            # adapters on every projection (llama8: KV heads replicated at TP 8) and on phi3's fused ones
            "dp_lora": adapter(llama8, seed=1),
            "lora": {"llama8": [llama8, adapter(llama8), [8]],
                     "phi3": [str(hf_model_dir("phi3")), adapter(hf_model_dir("phi3"), targets=[
                         "qkv_proj", "gate_up_proj", "o_proj", "down_proj"]), [4]]}}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sharding_worker.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    result["dp_lora_reference"] = adapters[spec["dp_lora"]]
    return result


# TP 2 splits whole KV heads; TP 4 and 8 replicate them (qwen2: with its q/k/v biases)
@pytest.mark.parametrize("model, tp", [("llama8", 2), ("llama8", 8), ("qwen2", 4), ("phi3", 4),
                                       ("gemma3", 2), ("qwen2_moe", 2), ("olmo2", 2), ("deepseek_v3", 4)])
def test_tp_logits_match_single_device(multi_device, model, tp):
    assert multi_device[f"logits/{model}"][str(tp)] < 1e-4


def test_tp_past_the_kv_heads_of_a_model_normalizing_k_across_them_is_refused(hf_model_dir):
    """OLMo's k norm spans the checkpoint's KV heads: replicating them (TP 4 over 2) would change it."""
    config = ModelConfig.from_pretrained(hf_model_dir("olmo2"))
    assert shard_model_config(config, 2).fused_shards == 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 exceeds the model's 2 KV heads, which its k norm"):
        shard_model_config(config, 4)


@pytest.mark.parametrize("model, tp", [("llama8", 8), ("phi3", 4)])
def test_tp_lora_logits_match_single_device(multi_device, model, tp):
    """A batch mixing an adapter's prompts with the base model's: each device's share of the adapters' B rows
    follows its share of the fused weight's rows."""
    assert multi_device[f"lora/{model}"][str(tp)] < 1e-4


@pytest.mark.parametrize("tp", [8])
def test_pallas_kernel_runs_per_device_heads(multi_device, tp):
    """XLA cannot split a Pallas kernel: under TP it runs in a shard_map on each device's own heads (at TP 2 too:
    test_attention_sinks_split_over_the_devices_heads)."""
    assert multi_device["logits/pallas-interpret"][str(tp)] < 1e-4


def test_attention_sinks_split_over_the_devices_heads(multi_device):
    """gpt-oss at TP 2 on the Pallas kernel: each device's shard_map gets its own heads' sinks."""
    assert multi_device["logits/pallas-interpret-sinks"]["2"] < 1e-4


def test_tp_step_with_mosaic_kernel_lowers_for_tpu(multi_device):
    assert multi_device["tpu_export"] == {"mosaic_kernel": True, "per_device_shard_map": True}


@pytest.mark.parametrize("run", ["tp2", "tp8", "dp2xtp2", "tp2-draft"])
def test_tp_and_dp_greedy_tokens_identical(multi_device, run):
    assert multi_device["greedy_lengths"] == OUTPUT_LENGTHS
    assert multi_device["greedy"][run]


def test_data_parallel_replicas_serve_an_adapter_added_up_front(multi_device):
    """LLMEngine.add_lora on 2 replicas: every other prompt of the workload with the adapter gives PEFT's greedy
    tokens, the others the base model's (the worker checks both replicas served, and remove_lora)."""
    peft = multi_device["dp_lora_reference"]
    prompts, params = workload()
    for i, (prompt, p, tokens) in enumerate(zip(prompts, params, multi_device["dp_lora"], strict=True)):
        if i % 2 == 0:
            assert tokens == hf_greedy(peft, prompt["prompt_token_ids"], p.max_tokens), i
        else:
            with peft.disable_adapter():
                assert tokens == hf_greedy(peft, prompt["prompt_token_ids"], p.max_tokens), i


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_parameters_and_kv_cache_sharded_per_rules(multi_device, tp):
    report = multi_device[f"sharding/tp{tp}"]
    assert report["mismatches"] == []
    assert report["fractions"] == pytest.approx([1 / tp] * tp)  # each device holds 1/TP of the sharded weights
    assert report["kv_fractions"] == pytest.approx([1 / tp] * tp)  # and 1/TP of the KV cache (its own KV heads)
    assert report["kv_heads"] == max(2, tp)


def _start_pair(model_dir: Path, mode: str) -> list[subprocess.Popen]:
    with socket.socket() as s:  # a free loopback port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return [subprocess.Popen([sys.executable, str(REPO / "tests" / "multihost_worker.py"), str(model_dir), str(port),
                              str(i), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=REPO) for i in (0, 1)]


def _leader_tokens(leader: subprocess.Popen) -> list[list[int]]:
    """Read the leader's stdout up to READY; returns the tokens it printed."""
    tokens = None
    for line in leader.stdout:
        if line.startswith("[["):
            tokens = json.loads(line)
        if line.strip() == "READY":
            return tokens
    raise AssertionError(f"leader exited early: {leader.wait()} {leader.stderr.read()[-3000:]}")


def _exits_with_error(proc: subprocess.Popen, within: float) -> float:
    start = time.monotonic()
    try:
        code = proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running {within} s after its peer died") from None
    assert code != 0, "exited cleanly although its peer died"
    return time.monotonic() - start


@pytest.mark.parametrize("killed", ["follower", "leader"])
def test_two_processes_match_one_and_fail_when_a_peer_dies(hf_model_dir, llm_factory, killed):
    """TP = 4 over two jax.distributed processes (2 CPU devices each, gloo collectives) gives the tokens of one
    device; killing either process makes the other exit non-zero within the heartbeat timeout (10 s) + slack."""
    model_dir = hf_model_dir("llama", num_attention_heads=8)
    procs = _start_pair(model_dir, "die")
    try:
        tokens = _leader_tokens(procs[0])
        assert tokens == greedy_tokens(llm_factory(model_dir, **ENGINE_ARGS))
        victim, survivor = (procs[1], procs[0]) if killed == "follower" else (procs[0], procs[1])
        victim.kill()
        _exits_with_error(survivor, within=45)
    finally:
        for p in procs:
            p.kill()
            p.wait()
