"""What the sections share: the section's arguments, its results file written as it goes, the model shapes, timing."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B), the shape the speed sections measure with dummy weights.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B): a mixture of experts, 128 experts of which a token reaches 8,
# 30.5B parameters of which a token reads 3.3B (its model card's figures).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "attention_bias": False,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite): latent attention (one 576-wide KV head a token),
# a dense first layer, then 64 experts of which a token reaches 6 beside 2 shared ones; 15.7B parameters of which a
# token reads 2.4B (its model card's figures).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 0.707, "mscale_all_dim": 0.707,
                                          "original_max_position_embeddings": 4096},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}
# --model names whose config.json the check writes itself (with dummy weights)
SHAPES = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}


class Results:
    """A section's results, rewritten to its JSON file after every record: a section stopped at its time limit
    keeps everything it finished."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data: dict = {}

    def record(self, key: str, value) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
        print(f"[{self.path.stem}] {key}: {json.dumps(value, default=str)[:400]}", flush=True)

    def append(self, key: str, value) -> None:
        self.record(key, [*self.data.get(key, []), value])


def section_args() -> tuple[dict, Results]:
    """A section process's arguments (JSON in argv[1]) and its results file (argv[2])."""
    args = json.loads(sys.argv[1])
    return args, Results(sys.argv[2])


def model_dir(spec: str, work: Path) -> tuple[Path, str]:
    """(checkpoint directory, load_format) for --model: "demo" (the bundled checkpoint), a name of SHAPES (its
    config.json beside the demo tokenizer, dummy weights), or a directory (dummy weights unless it has safetensors)."""
    from checkpoints import DEMO_MODEL_DIR

    if spec == "demo":
        return DEMO_MODEL_DIR, "auto"
    if spec in SHAPES:
        out = work / spec
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(SHAPES[spec]))
        for name in ("tokenizer.json", "tokenizer_config.json"):  # ids past its vocabulary decode to nothing
            shutil.copy(DEMO_MODEL_DIR / name, out / name)
        return out, "dummy"
    path = Path(spec)
    has_weights = any(path.glob("*.safetensors"))
    return path, "auto" if has_weights else "dummy"


def work_dir() -> Path:
    return Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check_"))


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of fn() (which must block until its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
