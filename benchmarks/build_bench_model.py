"""Build the 135M-shaped benchmark model: a SmolLM-135M-shaped Llama with random weights and a trained tokenizer.

    python benchmarks/build_bench_model.py [OUT_DIR] [--dtype float32|bfloat16] [--seed 0] [--num-layers 30] [--force]

OUT_DIR defaults to ~/.cache/jserve/bench-135m. The shape (hidden 576, 30 layers, 9 heads / 3 KV heads,
intermediate 1536, vocab 49152, tied embeddings) is SmolLM-135M's, the model docs/benchmarks.md measures jserve,
llama.cpp and transformers on. --num-layers N builds the same shape with N layers: 75 layers make a 588 MB
bfloat16 model, larger than a 260 MiB L3, for batch-1 decode read from memory. Weights are random (transformers' own
initialisation under a fixed torch seed): speed does not depend on what the weights say, and nothing is downloaded.

The tokenizer is a byte-level BPE with exactly 49152 tokens, trained in about 20 s on the running interpreter's
standard library with the same recipe as the demo checkpoint (tools/train_demo.py): the demo's own
tokenizer has only 4096 tokens, and a random model samples ids from all 49152, which must all decode.

Idempotent: a directory whose build.json records the same settings is left alone (--force rebuilds it). The
build goes to a temporary sibling directory that is renamed into place, so an interrupted build leaves nothing
half-written behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("~/.cache/jserve/bench-135m").expanduser()
BUILD_FILE = "build.json"
BUILD_VERSION = 1  # bump when the recipe changes so old directories are rebuilt

# SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config.json).
MODEL_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, hidden_act="silu",
)


def model_shape(num_layers: int = MODEL_SHAPE["num_hidden_layers"]) -> dict:
    return {**MODEL_SHAPE, "num_hidden_layers": num_layers}


def build_settings(dtype: str, seed: int, shape: dict = MODEL_SHAPE) -> dict:
    return {"version": BUILD_VERSION, "dtype": dtype, "seed": seed, "shape": shape}


def is_built(out: Path, settings: dict) -> bool:
    try:
        recorded = json.loads((out / BUILD_FILE).read_text())
    except (OSError, ValueError):
        return False
    return recorded == settings and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def build(out: Path, dtype: str, seed: int, shape: dict = MODEL_SHAPE) -> None:
    sys.path.insert(0, str(REPO_ROOT))  # the tokenizer recipe lives in tools/, beside this script
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from tools import train_demo

    tokenizer = train_demo.train_tokenizer(train_demo.read_texts(train_demo.stdlib_files()), shape["vocab_size"])
    if len(tokenizer) != shape["vocab_size"]:
        raise RuntimeError(f"the tokenizer came out with {len(tokenizer)} tokens, not {shape['vocab_size']}")
    eos = tokenizer.convert_tokens_to_ids(train_demo.EOS)
    im_end = tokenizer.convert_tokens_to_ids(train_demo.IM_END)
    config = LlamaConfig(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=[eos, im_end], pad_token_id=eos)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        train_demo._portable_tokenizer_config(tmp / "tokenizer_config.json")
        (tmp / BUILD_FILE).write_text(json.dumps(build_settings(dtype, seed, shape), indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {out}: {params / 1e6:.1f}M parameters ({dtype}), tokenizer of {len(tokenizer)} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"output directory ({DEFAULT_OUT})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="stored weight dtype; jserve and llama.cpp's converter can make bf16 from float32")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    parser.add_argument("--num-layers", type=int, default=MODEL_SHAPE["num_hidden_layers"],
                        help="decoder layers (30, SmolLM-135M's); more make a model that outgrows the L3")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is up to date")
    args = parser.parse_args(argv)
    if args.num_layers < 1:
        parser.error("--num-layers must be at least 1")
    shape = model_shape(args.num_layers)
    out = args.out.expanduser().resolve()
    if not args.force and is_built(out, build_settings(args.dtype, args.seed, shape)):
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    build(out, args.dtype, args.seed, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
