"""Batch-1 decode of model families on the CPU executors (dummy bfloat16 weights): Gemma 3 270M's shape
(google/gemma-3-270m's config.json), the same shape as a plain Llama, and Gemma 2's layers (sandwich norms, soft
caps, a window on every other layer) at that shape; and a mixture of experts, Qwen3-30B-A3B's shape cut to 6 layers.
Each runs `jserve bench latency` on the CPU layer executor and on the XLA executor (the Flax model with the C++
attention kernel), in turns round by round.

    python benchmarks/family_shapes.py --rounds 3 --output-len 128
    python benchmarks/family_shapes.py --shapes qwen3_moe --executors xla
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkpoints import DEMO_MODEL_DIR

# google/gemma-3-270m's config.json (text fields).
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 6, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1,
}
SHAPES = {
    "gemma3": GEMMA3_270M,
    "gemma2": {**{k: v for k, v in GEMMA3_270M.items() if k not in ("rope_local_base_freq", "sliding_window_pattern")},
               "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              **{k: GEMMA3_270M[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                                             "bos_token_id", "eos_token_id")}},
    # Qwen/Qwen3-30B-A3B's config.json with 6 of its 48 layers (each holds 1.2 GB of bf16 experts): a token reads the
    # router and 8 of the 128 experts of each layer, about a tenth of the layer.
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                  "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 151643,
                  "eos_token_id": 151645},
}


def model_dir(work: Path, name: str) -> Path:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[name]))
    for file in ("tokenizer.json", "tokenizer_config.json"):  # ids past its vocabulary decode to nothing
        shutil.copy(DEMO_MODEL_DIR / file, out / file)
    return out


def decode(path: Path, executor: str, args: argparse.Namespace, work: Path) -> tuple[float, float]:
    """(batch-1 decode tok/s, its share of the read-bandwidth roofline), medians of `jserve bench latency`."""
    result = work / "latency.json"
    subprocess.run([sys.executable, "-m", "jserve", "bench", "latency", "--model", str(path), "--load-format", "dummy",
                    "--dtype", "bfloat16", "--executor", executor, "--max-model-len", "1024", "--input-len", "32",
                    "--output-len", str(args.output_len), "--num-iters", str(args.iters), "--result-json", str(result)],
                   check=True, capture_output=True, text=True)
    report = json.loads(result.read_text())
    return report["decode_tokens_per_s"], report["decode_fraction_of_roofline"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--shapes", default="gemma3,llama,gemma2")
    parser.add_argument("--executors", default="cpu-layers,xla")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="family_shapes_"))
    runs = [(shape, executor) for shape in args.shapes.split(",") for executor in args.executors.split(",")]
    paths = {shape: model_dir(work, shape) for shape, _ in runs}
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for shape, executor in runs:
            figures[shape, executor].append(decode(paths[shape], executor, args, work))
    print("| shape | executor | batch-1 decode tok/s, median (rounds) | share of the roofline, median |")
    print("| --- | --- | --- | --- |")
    for (shape, executor), values in figures.items():
        speeds = [v[0] for v in values]
        print(f"| {shape} | {executor} | {statistics.median(speeds):.1f} ({', '.join(f'{v:.1f}' for v in speeds)}) "
              f"| {statistics.median(v[1] for v in values):.0%} |")


if __name__ == "__main__":
    main()
