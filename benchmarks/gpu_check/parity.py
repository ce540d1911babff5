"""Section parity: the tiny model families of the parity tests on this device, against transformers on the same
device: float32 greedy tokens identical (the engine with the Triton kernel and with the reference attention),
all-position logits close in float32 and in bfloat16.

transformers runs float32 without TF32 (torch's default for matmuls); the engine's float32 dots ask for HIGHEST
precision for the same reason.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.gpu_check.common import REPO, section_args

sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builders the parity tests use

PROMPT_LENS = (5, 37, 20, 1)
NEW_TOKENS = 16
BF16_LOGIT_TOLERANCE = 0.15  # tests/test_parity.py's: bf16 activation rounding on transformers' side


def hf_greedy(model, prompt: list[int], steps: int, device) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logits(model, prompt: list[int], device) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt], device=device)).logits[0].float().cpu().numpy()


def engine_tokens(model_dir: Path, prompts, backend: str, dtype: str) -> list[list[int]]:
    from jserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, attention_backend=backend, max_model_len=128, max_num_batched_tokens=64,
              max_num_seqs=8, kv_cache_memory_bytes=8 << 20, warmup=False, compilation_cache_dir="")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    import jax
    import torch
    from hf_models import VARIANTS, build_model, load_hf, save_tokenizer
    from test_parity import jserve_logits as engine_logits  # all-position logits in one ragged step

    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    device = torch.device("cuda" if on_gpu and torch.cuda.is_available() else "cpu")
    kernel = "pallas" if on_gpu else "pallas-interpret-gpu"
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 390, n).tolist() for n in PROMPT_LENS]
    variants = args.get("variants") or list(VARIANTS)
    work = Path(tempfile.mkdtemp(prefix="parity_"))
    for variant in variants:
        entry: dict = {"variant": variant}
        try:
            model_dir = build_model(variant, work / variant)
            save_tokenizer(model_dir)
            hf = load_hf(model_dir).to(device)
            expected = [hf_greedy(hf, p, NEW_TOKENS, device) for p in prompts]
            for backend in (kernel, "reference"):
                got = engine_tokens(model_dir, prompts, backend, "float32")
                entry[f"greedy_{backend}"] = got == expected
                if got != expected:
                    entry[f"first_mismatch_{backend}"] = next(
                        (i, g, e) for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e)
            ours = engine_logits(model_dir, prompts, "float32", kernel)
            entry["f32_max_logit_diff"] = max(float(np.abs(o - hf_logits(hf, p, device)).max())
                                              for o, p in zip(ours, prompts, strict=True))
            if variant in ("llama", "qwen3"):
                hf16 = load_hf(model_dir, torch.bfloat16).to(device)
                ours16 = engine_logits(model_dir, prompts, "bfloat16", kernel)
                entry["bf16_max_logit_diff"] = max(float(np.abs(o - hf_logits(hf16, p, device)).max())
                                                   for o, p in zip(ours16, prompts, strict=True))
                entry["bf16_ok"] = entry["bf16_max_logit_diff"] < BF16_LOGIT_TOLERANCE
            entry["ok"] = all(entry[f"greedy_{b}"] for b in (kernel, "reference")) and entry.get("bf16_ok", True)
        except Exception as e:
            entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        results.append("families", entry)
    results.record("device", {"jax": jax.default_backend(), "torch": str(device), "kernel_backend": kernel})


if __name__ == "__main__":
    main()
