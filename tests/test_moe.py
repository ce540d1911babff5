"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): the router and the grouped expert loop against a NumPy
loop over tokens, batches against each request alone, and the config fields against transformers' models.
Logits and greedy tokens against transformers run in tests/test_parity.py (the mixtral, qwen2_moe and qwen3_moe
variants), GGUF files in tests/test_gguf.py, int8 / fp8 experts in tests/test_quantization.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cpu_kernels
from jserve.config import ModelConfig, ModelLoadError
from jserve.models.moe import Experts, grouped_experts, route, tile_rows
from jserve.sampling_params import SamplingParams

E, H, WIDTH = 6, 16, 24


def numpy_route(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, -1)
    return (weights / weights.sum(-1, keepdims=True) if normalize else weights), ids


def _experts(rng: np.random.Generator) -> tuple[Experts, dict[str, np.ndarray]]:
    config = ModelConfig(model_type="qwen3_moe", vocab_size=8, hidden_size=H, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=H, num_experts=E, num_experts_per_tok=2,
                         moe_intermediate_size=WIDTH)
    experts = Experts(config, jnp.float32)
    arrays = {name: rng.normal(0, 0.3, getattr(experts, name).weight.shape).astype(np.float32)
              for name in ("gate_proj", "up_proj", "down_proj")}
    for name, array in arrays.items():
        getattr(experts, name).weight = nnx.Param(jnp.asarray(array))
    return experts, arrays


@pytest.mark.parametrize("normalize", [True, False])
def test_route_is_softmax_then_top_k(normalize):
    logits = np.random.default_rng(0).normal(0, 2, (9, E)).astype(np.float32)
    weights, ids = route(jnp.asarray(logits), 3, normalize)
    want_weights, want_ids = numpy_route(logits, 3, normalize)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)


@pytest.mark.parametrize("groups, topk_groups, normalize", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_grouped_sigmoid_routing_matches_transformers_router(groups, topk_groups, normalize):
    """GLM-4.5's router (transformers' own Glm4MoeTopkRouter, a random correction bias): the same experts chosen for
    each token and the same weights, scaled."""
    import torch
    import transformers

    config = transformers.Glm4MoeConfig(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=groups,
                                        topk_group=topk_groups, norm_topk_prob=normalize, routed_scaling_factor=2.5)
    router = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(config)
    torch.manual_seed(groups)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(24, 16)
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
    logits = x.numpy() @ router.weight.detach().numpy().T
    from jserve.models.moe import route_sigmoid_groups

    weights, ids = route_sigmoid_groups(jnp.asarray(logits), 4, normalize,
                                        jnp.asarray(router.e_score_correction_bias.numpy()), groups, topk_groups, 2.5)
    order, want_order = np.argsort(np.asarray(ids), -1), np.argsort(want_ids.numpy(), -1)  # torch: unsorted top-k
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1),
                                  np.take_along_axis(want_ids.numpy(), want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_weights.numpy(), want_order, -1), rtol=1e-5)


# 2 tokens x 2: fewer pairs than experts (a tile a pair); 5 x 3: tiles of 4 rows; 40 x 2: tiles of 16, most experts
# split over several tiles. Some tokens are padding, and with few tokens some experts get none.
@pytest.mark.parametrize("num_tokens, k", [(2, 2), (5, 3), (40, 2)])
def test_grouped_experts_match_a_loop_over_tokens(num_tokens, k):
    rng = np.random.default_rng(num_tokens)
    experts, w = _experts(rng)
    x = rng.normal(0, 1, (num_tokens, H)).astype(np.float32)
    weights, ids = numpy_route(rng.normal(0, 1, (num_tokens, E)).astype(np.float32), k, True)
    valid = np.arange(num_tokens) < num_tokens - 1  # the last token is padding
    got = jax.jit(lambda x, w, i, v: grouped_experts(x, w, i, v, experts))(
        jnp.asarray(x), jnp.asarray(weights, jnp.float32), jnp.asarray(ids, jnp.int32), jnp.asarray(valid))
    want = np.zeros((num_tokens, H), np.float32)
    for t in range(num_tokens - 1):
        for weight, e in zip(weights[t], ids[t], strict=True):
            gate, up = w["gate_proj"][e] @ x[t], w["up_proj"][e] @ x[t]
            want[t] += weight * (w["down_proj"][e] @ (gate / (1 + np.exp(-gate)) * up))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert not np.asarray(got)[-1].any()  # padding reaches no expert


def test_tile_rows():
    assert tile_rows(8, 8) == 1 and tile_rows(4, 128) == 1  # decode: a tile a pair
    assert tile_rows(9, 8) == 2 and tile_rows(4096, 128) == 32 and tile_rows(4000, 8) == 512


def test_config_fields_follow_transformers():
    import transformers

    mixtral = ModelConfig.from_hf_dict(transformers.MixtralConfig(num_hidden_layers=2).to_dict())
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.moe_layers) == (8, 2, 14336, True, None)
    qwen3 = ModelConfig.from_hf_dict(transformers.Qwen3MoeConfig(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True).to_dict())
    assert qwen3.moe_layers == (False, True, False, False) and qwen3.norm_topk_prob and qwen3.qk_norm
    # as transformers' own layers: a mixture of experts where its decoder layer built a sparse block
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_hidden_layers=4, decoder_sparse_step=2,
        mlp_only_layers=[3]))
    assert [hasattr(layer.mlp, "experts") for layer in hf.model.layers] == list(qwen3.moe_layers)
    qwen2 = ModelConfig.from_hf_dict(transformers.Qwen2MoeConfig(num_hidden_layers=2).to_dict())
    assert (qwen2.shared_expert_intermediate_size, qwen2.qkv_bias, qwen2.norm_topk_prob) == (5632, True, False)


@pytest.mark.parametrize("bend, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) exceeds the 8 experts"),
    ({"num_experts": 0}, "num_experts must be a positive integer"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers must list layer indices below 2"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
])
def test_bad_moe_fields_are_named(bend, message):
    import transformers

    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=2).to_dict()
    cfg.pop("num_local_experts", None)  # transformers 5's name; the published checkpoints say num_experts
    cfg = {**cfg, "num_experts": 8, **bend}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("executor", ["reference"], ids=["xla"])
def test_batched_requests_equal_each_alone(hf_model_dir, llm_factory, executor):
    """Routing is per token: 8 requests batched (tiles shared between sequences, padding tokens) give each one's
    tokens alone, sampled with seeds too. The routing and tiling are the Flax model's on both executors (the CPU
    layer executor's expert matmuls are checked by the parity tests' logits)."""
    llm = llm_factory(hf_model_dir("qwen3_moe"), attention_backend=executor)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, int(n)).tolist()} for n in rng.integers(3, 40, 8)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(8)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [s], use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(prompts, params,
                                                                                             strict=True)]
    assert batched == alone


def test_bfloat16_executors_agree(hf_model_dir):
    """bfloat16 on the CPU layer executor (packed experts and projections, the C++ matmuls) and on the XLA executor
    (XLA's dots): both round each matmul's input to bfloat16 and sum in float32, in different orders, so an input
    now and then rounds to the neighbouring bfloat16 value (~0.01 on these logits), far inside the 0.15 allowed
    against transformers."""
    from test_parity import _prompts, jserve_logits

    model_dir = hf_model_dir("qwen2_moe")
    prompts = _prompts(2)
    for cpu, xla in zip(jserve_logits(model_dir, prompts, "bfloat16", "cpu"),
                        jserve_logits(model_dir, prompts, "bfloat16"), strict=True):
        assert np.abs(cpu - xla).max() < 0.05


def test_a_checkpoint_missing_an_expert_is_named(hf_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    from jserve.loading import load_model

    source = hf_model_dir("mixtral")
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    for f in source.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_text(f.read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model.layers.1.mlp.experts.N.down_proj.weight"):
        load_model(tmp_path, "float32")


def test_glm_multi_token_prediction_layers_are_left_unread(hf_model_dir, tmp_path):
    """GLM-4.5 checkpoints end with num_nextn_predict_layers layers past the decoder's (multi-token prediction),
    which transformers does not load either: the checkpoint with one more layer gives the same state."""
    from safetensors.numpy import load_file, save_file

    from jserve.loading import load_model

    source = hf_model_dir("glm4_moe")
    tensors = load_file(str(source / "model.safetensors"))
    extra = {name.replace("model.layers.2.", "model.layers.3.", 1): array for name, array in tensors.items()
             if name.startswith("model.layers.2.")}
    for f in source.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_text(f.read_text())
    save_file({**tensors, **extra, "model.layers.3.eh_proj.weight": np.ones((4, 4), np.float32)},
              str(tmp_path / "model.safetensors"))
    want = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(load_model(source, "float32").state)}
    got = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(load_model(tmp_path, "float32").state)}
    assert want.keys() == got.keys() and all(np.array_equal(want[p], got[p]) for p in want)
    assert np.asarray(got[("layers", 2, "mlp", "gate", "e_score_correction_bias")]).std() > 0


def test_dummy_weights_draw_every_expert(hf_model_dir, tmp_path):
    """load_format="dummy" from config.json alone: each expert's matrices drawn apart, the router too."""
    from jserve.loading import load_model

    for f in hf_model_dir("mixtral").iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_text(f.read_text())
    model = load_model(tmp_path, "float32", load_format="dummy")
    flat = {"/".join(map(str, path)): np.asarray(v) for path, v in nnx.to_flat_state(model.state)}
    gate = flat["layers/0/mlp/experts/gate_proj/weight"]
    assert gate.shape == (4, 128, 64) and flat["layers/0/mlp/experts/down_proj/weight"].shape == (4, 64, 128)
    assert not np.array_equal(gate[0], gate[1]) and flat["layers/0/mlp/gate/weight"].std() > 0


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels do not build here")
def test_the_cpu_layer_executor_packs_experts_for_its_matmuls(hf_model_dir):
    """On the CPU layer executor a mixture of experts runs the Flax model with its matrices packed for the C++
    matmuls: each expert stack as a stack of packed matrices, the projections and the shared expert packed; the
    router stays a plain matrix (XLA's dot)."""
    from jserve.executors import CpuLayerExecutor

    if not cpu_kernels.packs_weights("bfloat16"):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    model = CpuLayerExecutor.load(hf_model_dir("qwen2_moe"), dtype="bfloat16")
    flat = {path: v[...] for path, v in nnx.to_flat_state(model.state)}
    assert cpu_kernels.is_packed_stack(flat[("layers", 1, "mlp", "experts", "gate_proj", "weight")])
    assert cpu_kernels.is_packed(flat[("layers", 1, "mlp", "shared_expert", "gate_up_proj", "weight")])
    assert cpu_kernels.is_packed(flat[("layers", 0, "mlp", "gate_up_proj", "weight")])  # the dense layer
    assert cpu_kernels.is_packed(flat[("layers", 0, "self_attn", "qkv_proj", "weight")])
    assert flat[("layers", 1, "mlp", "gate", "weight")].ndim == 2


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels do not build here")
def test_int8_experts_on_both_executors(hf_model_dir):
    """int8 weights (experts included, per row): the CPU layer executor's packed int8 matmuls against the XLA
    executor's quantized dots, which differ by the C++ kernel's quantization of x where the CPU has VNNI."""
    from test_parity import _prompts

    from jserve.executors import CpuLayerExecutor, XlaExecutor

    model_dir = hf_model_dir("qwen2_moe")
    logits = {}
    for name, executor, backend in (("cpu", CpuLayerExecutor, "cpu"), ("xla", XlaExecutor, "reference")):
        model = executor.load(model_dir, dtype="float32", attention_backend=backend, quantization="int8",
                              max_model_len=256)
        flat = {path: v[...] for path, v in nnx.to_flat_state(model.state)}
        assert flat[("layers", 1, "mlp", "experts", "down_proj", "weight")].dtype == jnp.int8
        runner = executor(model, dtype="float32", num_blocks=32, block_size=16, max_num_batched_tokens=128,
                          max_num_seqs=8, max_model_len=256)
        logits[name] = _all_logits(runner, _prompts(3)[1])
    # 0.03 here with VNNI's quantized x (logits of magnitude ~1); a wrong expert or scale moves them by far more
    assert np.abs(logits["cpu"] - logits["xla"]).max() < 0.1


def _all_logits(runner, prompt: list[int]) -> np.ndarray:
    from jserve.engine.sequence import ScheduledSeq, Sequence

    seq = Sequence("moe", prompt, SamplingParams())
    seq.block_table = list(range(-(-len(prompt) // 16)))
    batch = runner.prepare([ScheduledSeq(seq, len(prompt), True)])
    batch.logits_indices = np.arange(len(batch.token_ids), dtype=np.int32)
    return np.asarray(runner.run(batch), np.float32)[:len(prompt)]
