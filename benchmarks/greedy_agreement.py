"""Greedy agreement of two engine settings (e.g. bfloat16 against int8 weights or an int8 KV cache) on the same
prompts: how many of each stream's tokens match before its first divergence, and how many streams match whole.

    python -m benchmarks.greedy_agreement --model PATH --prompts 64 --tokens 64 \
        --a '{"dtype": "bfloat16", "executor": "xla"}' \
        --b '{"dtype": "bfloat16", "executor": "xla", "quantization": "int8"}'

The prompts are consecutive slices of jserve eval's held-out English text (48 tokens each); EOS is ignored so
every stream has --tokens tokens. One engine at a time, so the two never share the machine's memory.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import jserve
from jserve.engine.engine import model_path
from jserve.tokenizer import load_tokenizer


def prompts_from_text(tokenizer, count: int, length: int) -> list[list[int]]:
    text = (Path(jserve.__file__).parent / "eval" / "data" / "heldout_en.txt").read_text()
    ids = tokenizer.encode(text)
    if len(ids) < count * length:
        raise SystemExit(f"the held-out text gives {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def generate(model: str, settings: dict, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    llm = jserve.LLM(model, **settings)
    params = jserve.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    gc.collect()
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefixes = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        prefixes.append(same)
    total = sum(len(x) for x in a)
    return {"streams": len(a), "tokens_per_stream": len(a[0]) if a else 0,
            "identical_streams": sum(p == len(x) for p, x in zip(prefixes, a, strict=True)),
            "tokens_before_first_divergence": sum(prefixes) / total if total else 1.0,
            "positionwise_equal": sum(p == q for x, y in zip(a, b, strict=True)
                                      for p, q in zip(x, y, strict=True)) / total if total else 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--a", default="{}", help="engine settings (JSON) of the reference run")
    parser.add_argument("--b", required=True, help="engine settings (JSON) of the compared run")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=48)
    args = parser.parse_args(argv)
    common = {"max_model_len": -(-(args.prompt_len + args.tokens) // 16) * 16 + 16}
    prompts = prompts_from_text(load_tokenizer(str(model_path(args.model))).hf, args.prompts, args.prompt_len)
    a = generate(args.model, {**common, **json.loads(args.a)}, prompts, args.tokens)
    b = generate(args.model, {**common, **json.loads(args.b)}, prompts, args.tokens)
    print(json.dumps({"model": args.model, "a": json.loads(args.a), "b": json.loads(args.b),
                      **agreement(a, b)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
