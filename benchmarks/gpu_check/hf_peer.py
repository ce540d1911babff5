"""Section hf: the same-run peer, transformers' `generate` on the same model shape and device (random bf16 weights,
greedy, static cache, SDPA attention, eager: transformers would torch.compile a static-cache forward, minutes
of compiling the check cannot spend): batch-1 decode rate, and output tokens per second at batch 64."""

from __future__ import annotations

import json
import time

from benchmarks.gpu_check.common import model_dir, section_args, work_dir


def main() -> None:
    import torch
    import transformers

    args, results = section_args()
    device = torch.device("cuda" if args["device"] == "gpu" else "cpu")
    path, _ = model_dir(args["model"], work_dir())
    config = transformers.AutoConfig.from_pretrained(path)
    dtype = torch.bfloat16 if args.get("dtype", "bfloat16") == "bfloat16" else torch.float32
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    results.record("init_seconds", time.perf_counter() - start)
    results.record("versions", {"torch": torch.__version__, "transformers": transformers.__version__,
                                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"})
    vocab = min(config.vocab_size, 32000)
    in_len, out_len = (int(x) for x in args.get("hf_io", "128/128").split("/"))

    def generate(batch: int, new_tokens: int) -> float:
        ids = torch.randint(10, vocab, (batch, in_len), device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                                 disable_compile=True, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == in_len + new_tokens, out.shape
        return time.perf_counter() - begin

    for batch in args.get("hf_batches", [1, 64]):
        try:
            generate(batch, 4)  # warm: kernels, the static cache's allocation
            prefill = generate(batch, 1)
            whole = generate(batch, out_len)
            entry = {"batch": batch, "input": in_len, "output": out_len, "seconds": whole,
                     "output_tok_s": batch * out_len / whole,
                     "decode_tok_s_per_seq": (out_len - 1) / max(whole - prefill, 1e-9)}
            results.append("generate", entry)
        except Exception as e:
            results.append("generate", {"batch": batch, "error": f"{type(e).__name__}: {e}"[:2000]})
    print(json.dumps(results.data)[:2000])


if __name__ == "__main__":
    main()
