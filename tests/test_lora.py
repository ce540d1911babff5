"""LoRA adapters against PEFT running the same adapter on transformers' model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_models import load_hf
from test_parity import hf_greedy, hf_logits, jserve_logits

import cpu_kernels
from jserve.lora import LoRAError, LoRARequest, load_adapter
from jserve.sampling_params import SamplingParams

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXECUTORS = ["xla", pytest.param("cpu-layers", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                                                       reason="the C++ kernels do not build here"))]


def make_adapter(model_dir, out_dir, *, rank: int = 4, alpha: float = 8, targets=None, seed: int = 0,
                 rslora: bool = False):
    """A PEFT adapter with random A and B (PEFT's own init leaves B zero: the adapter would change nothing), saved as
    PEFT saves it; returns the PEFT model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, init_lora_weights=False,
                        use_rslora=rslora)
    model = get_peft_model(load_hf(model_dir), config)
    with torch.no_grad():  # big enough to move the greedy tokens of a tiny random model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(hf_model_dir, tmp_path_factory):
    """Factory: (adapter dir, PEFT model) per (variant, adapter settings), built once."""
    cache = {}

    def make(variant: str = "llama", **settings):
        key = (variant, tuple(sorted((k, str(v)) for k, v in settings.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"lora-{variant}")
            cache[key] = out, make_adapter(hf_model_dir(variant), out, **settings)
        return cache[key]

    return make


PROMPTS = [[5, 17, 300, 42, 9, 77, 123], [3, 8, 250, 11], [99, 100, 101, 102, 103, 104, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("variant, executor, settings", [
    ("llama", "xla", {}),
    ("llama", "cpu-layers", {}),
    ("qwen3", "xla", dict(targets=["q_proj", "v_proj", "down_proj"], rslora=True)),  # q/k norm, some targets
    ("phi3", "xla", dict(targets=["qkv_proj", "gate_up_proj", "o_proj"])),  # fused, partial rotary, longrope
    ("granite", "cpu-layers", dict(targets=["o_proj", "down_proj", "k_proj"], rank=8)),  # residual multiplier
])
def test_adapter_logits_match_peft_in_a_batch_mixing_adapters(hf_model_dir, adapters, variant, executor, settings):
    """One step holding a prompt of each of two adapters and one of the base model: each prompt's float32 logits are
    PEFT's with its adapter (the base model's without)."""
    if executor == "cpu-layers" and not cpu_kernels.available():
        pytest.skip("the C++ kernels do not build here")
    model_dir = hf_model_dir(variant)
    first, first_ref = adapters(variant, **settings)
    second, second_ref = adapters(variant, **{**settings, "seed": 1})
    ours = jserve_logits(model_dir, PROMPTS, "float32", "cpu" if executor == "cpu-layers" else "reference",
                         adapters=(first, second), slots=[1, -1, 0])
    with second_ref.disable_adapter():
        base = hf_logits(second_ref, PROMPTS[1])
    np.testing.assert_allclose(ours[0], hf_logits(second_ref, PROMPTS[0]), atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[1], base, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[2], hf_logits(first_ref, PROMPTS[2]), atol=1e-4, rtol=0)
    assert np.abs(ours[2] - hf_logits(second_ref, PROMPTS[2])).max() > 0.1  # the adapters differ


@pytest.mark.parametrize("executor", EXECUTORS)
def test_engine_serves_adapters_with_fewer_slots_than_adapters(hf_model_dir, adapters, llm_factory, executor):
    """Three adapters and the base model over one slot, with prefix caching on and every request sharing a prompt
    prefix: each request's greedy tokens are PEFT's with its adapter, the same as it alone gives."""
    from jserve import LoRARequest as TopLevelLoRARequest

    model_dir = hf_model_dir("llama")
    refs = [adapters("llama", seed=s) for s in range(3)]
    llm = llm_factory(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8,
                      attention_backend="cpu" if executor == "cpu-layers" else "reference", executor=executor)
    requests = [TopLevelLoRARequest(f"adapter-{i}", i + 1, str(path)) for i, (path, _) in enumerate(refs)]
    prefix = [5, 17, 300, 42, 9, 77, 123, 64, 11, 250, 3, 8, 99, 100, 101, 102, 7]  # a whole block and a bit
    prompts = [prefix + [200 + i] for i in range(8)]
    loras = [requests[i % 3] if i % 4 != 3 else None for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=6)
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, outputs, strict=True):
        assert out.lora_request == lora  # vLLM's RequestOutput.lora_request
        ref = refs[lora.lora_int_id - 1][1] if lora is not None else refs[0][1]
        if lora is None:
            with ref.disable_adapter():
                expected = hf_greedy(ref, prompt, 6)
        else:
            expected = hf_greedy(ref, prompt, 6)
        assert out.outputs[0].token_ids == expected, lora
    alone = llm.generate([prompts[1]], params, lora_request=loras[1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert llm.engine.lora_slots.loads >= 3  # the one slot took each adapter in turn

    # vLLM's remove_lora: a request running with the adapter finishes with it, and the id may at once name another
    # adapter, whose request gets its own tokens: it waits for the one slot, and the old adapter's K/V of the same
    # prompt in the prefix cache are not its own
    engine = llm.engine
    assert engine.list_loras() == {1, 2, 3}
    engine.add_request("running", {"prompt_token_ids": prompts[0]}, params, lora_request=requests[0])
    finished = [o for o in engine.step() if o.finished]
    assert engine.remove_lora(1) and not engine.remove_lora(1) and engine.list_loras() == {2, 3}
    reused = TopLevelLoRARequest("adapter-1-again", 1, str(refs[1][0]))
    engine.add_request("reused", {"prompt_token_ids": prompts[0]}, params, lora_request=reused)
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    tokens = {o.request_id: o.outputs[0].token_ids for o in finished}
    assert tokens["running"] == outputs[0].outputs[0].token_ids
    assert tokens["reused"] == hf_greedy(refs[1][1], prompts[0], 6) != tokens["running"]
    with pytest.raises(LoRAError, match="lora_int_id 1 already names adapter 'adapter-1-again'"):
        engine.add_lora(requests[0])
    assert engine.add_lora(TopLevelLoRARequest("adapter-4", 4, str(refs[2][0]))) and engine.list_loras() == {1, 2, 3, 4}


def test_adapter_errors_name_what_does_not_fit(hf_model_dir, adapters, tmp_path, llm_factory):
    model_dir = hf_model_dir("llama")
    path, _ = adapters("llama", rank=8)
    from jserve.loading import model_config

    config = model_config(model_dir)
    with pytest.raises(LoRAError, match="rank 8 exceeds max_lora_rank 4"):
        load_adapter(LoRARequest("a", 1, str(path)), config, 4)
    with pytest.raises(LoRAError, match="not a LoRA adapter directory"):
        load_adapter(LoRARequest("a", 1, str(tmp_path)), config, 8)
    bad = tmp_path / "dora"
    bad.mkdir()
    cfg = json.loads((path / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA is not supported"):
        load_adapter(LoRARequest("a", 1, str(bad)), config, 8)
    head = tmp_path / "head"
    make_adapter(model_dir, head, targets=["lm_head", "q_proj"])
    with pytest.raises(LoRAError, match="lm_head"):
        load_adapter(LoRARequest("a", 1, str(head)), config, 8)
    with pytest.raises(ValueError, match="greater|>= 1"):
        LoRARequest("a", 0, str(path))
    llm = llm_factory(model_dir)
    with pytest.raises(ValueError, match="needs an engine started with enable_lora"):
        llm.generate(["hi"], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, str(path)))
    lora_llm = llm_factory(model_dir, enable_lora=True, max_lora_rank=8)
    lora_llm.generate(["hi"], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, str(path)),
                      use_tqdm=False)
    with pytest.raises(LoRAError, match="lora_int_id 1 already names adapter 'a'"):
        lora_llm.generate(["hi"], SamplingParams(max_tokens=1), lora_request=LoRARequest("b", 1, str(head)))


def test_no_recompilation_after_warmup_with_adapters(hf_model_dir, adapters):
    """Warm-up covers the steps and bursts of batches holding adapters and the writes of adapters into slots: a
    run mixing two adapters over one slot with the base model compiles nothing."""
    import jax
    from jax._src import dispatch  # the event name jax reports for each XLA compilation

    from jserve import LLM

    model_dir = hf_model_dir("llama")
    refs = [adapters("llama", seed=s) for s in range(2)]
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=32,
              max_num_seqs=4, warmup=True, compilation_cache_dir="", enable_lora=True, max_loras=1, max_lora_rank=8,
              attention_backend="reference")
    requests = [LoRARequest(f"a{i}", i + 1, str(path)) for i, (path, _) in enumerate(refs)]
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT else None)
    try:
        prompts = [[5 + i, 17, 300, 42, 9][: 2 + i % 4] for i in range(9)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                               lora_request=[requests[i % 2] if i % 3 else None for i in range(9)], use_tqdm=False)
    finally:
        jax.monitoring.clear_event_listeners()
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert compiles == []
    assert llm.engine.lora_slots.loads >= 2
