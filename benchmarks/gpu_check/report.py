"""The check's merged JSON as markdown tables (what docs/benchmarks.md's GPU section quotes)."""

from __future__ import annotations


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def markdown(merged: dict) -> str:
    sections = merged["sections"]
    out = ["# jserve GPU check", ""]
    env = sections.get("env", {})
    if env:
        versions, smi, device = env.get("versions", {}), env.get("nvidia_smi", {}), env.get("device", {})
        bw, mm = env.get("hbm_bandwidth", {}), env.get("bf16_matmul", {})
        out += _table(["device", "driver", "jax", "jaxlib", "flax", "torch", "transformers", "triton",
                       "HBM GB/s (measured)", "bf16 TFLOP/s (measured)"],
                      [[smi.get("gpu") or device.get("kind"), smi.get("driver"), versions.get("jax"),
                        versions.get("jaxlib"), versions.get("flax"), versions.get("torch"),
                        versions.get("transformers"), versions.get("triton"), bw.get("gb_per_s"), mm.get("tflops")]])
    kernels = sections.get("kernels", {})
    if kernels.get("correctness"):
        out += ["## Triton kernel against the reference (ragged mixed prefill/decode batches)", ""]
        out += _table(["heads/kv", "head_dim", "page", "dtype", "extra", "tokens", "rel. error", "ok"],
                      [[f"{c.get('heads')}/{c.get('kv_heads')}", c.get("head_dim"), c.get("page_size"),
                        c.get("dtype"), ", ".join(f"{k}={c[k]}" for k in ("sliding_window", "soft_cap", "kv_splits")
                                                  if k in c) or c.get("error", "")[:80],
                        c.get("tokens"), c.get("rel_error"), c.get("ok")] for c in kernels["correctness"]])
    if kernels.get("decode_timing"):
        out += ["## Decode attention, one layer, Llama-3-8B shape (32/8 heads, head_dim 128, bf16, page 16)", ""]
        out += _table(["batch", "context", "Triton µs", "share of HBM", "no split µs", "XLA gather µs",
                       "XLA / Triton"],
                      [[t.get("batch"), t.get("context"), t.get("pallas_us"), t.get("pallas_share_of_hbm"),
                        t.get("pallas_no_split_us"), t.get("xla_gather_us"), t.get("pallas_over_xla") or
                        t.get("error", "")[:80]] for t in kernels["decode_timing"]])
        tuned = [name[:-3] for name in kernels["decode_timing"][0] if name.endswith("_us")
                 and name not in ("pallas_us", "pallas_no_split_us", "xla_gather_us")]
        if tuned:
            out += _table(["batch", "context", "default µs", *[f"{name} µs" for name in tuned]],
                          [[t.get("batch"), t.get("context"), t.get("pallas_us"),
                            *[t.get(f"{name}_us") for name in tuned]] for t in kernels["decode_timing"]])
    parity = sections.get("parity", {})
    if parity.get("families"):
        out += ["## End to end against transformers on the same device (float32 greedy, 4 prompts x 16 tokens)", ""]
        kernel = parity.get("device", {}).get("kernel_backend", "pallas")
        out += _table(["family", f"greedy = HF ({kernel})", "greedy = HF (reference)", "f32 max |dlogit|",
                       "bf16 max |dlogit|", "ok"],
                      [[f["variant"], f.get(f"greedy_{kernel}"), f.get("greedy_reference"),
                        f.get("f32_max_logit_diff"), f.get("bf16_max_logit_diff"),
                        f.get("ok") if "error" not in f else f["error"][:80]] for f in parity["families"]])
    speed = sections.get("speed", {})
    if speed.get("settings"):
        settings, warm = speed["settings"], sections.get("warmup", {}).get("warmup", {})
        out += [f"## Engine speed: {settings.get('model')} ({settings.get('dtype')}, {settings.get('load_format')} "
                f"weights, attention {settings.get('attention_backend')}, XLA_FLAGS {settings.get('xla_flags')!r})",
                ""]
        out += _table(["load s", "full warm-up s", "step shapes", "burst shapes", "compiles in measured runs"],
                      [[speed.get("load_seconds"), warm.get("seconds") or sections.get("warmup", {}).get("status"),
                        warm.get("step_shapes"), warm.get("burst_shapes"), speed.get("compiles_in_measured_runs")]])
        b1 = speed.get("batch1_decode")
        if b1:
            steps_per_call = b1["model_steps"] / b1["engine_calls"] if b1.get("engine_calls") else None
            out += _table(["batch-1 decode tok/s", "ms/token", "roofline ms/token", "share of roofline",
                           "first run s (compiles)", "steps per engine call", "host ms per call"],
                          [[b1.get("tok_s"), b1.get("ms_per_token"), b1.get("roofline_ms"),
                            b1.get("share_of_roofline"), b1.get("cold_seconds"), steps_per_call,
                            b1.get("host_ms_per_call")]])
        hf = {g.get("batch"): g for g in sections.get("hf", {}).get("generate", [])}
        hf64 = hf.get(64, {}).get("output_tok_s")
        if speed.get("throughput"):
            out += _table(["concurrent", "in/out", "s", "output tok/s", "total tok/s", "share of roofline",
                           "first run s", "x HF batch-64"],
                          [[t.get("concurrent"), f"{t.get('input')}/{t.get('output')}", t.get("seconds"),
                            t.get("output_tok_s"), t.get("total_tok_s"), t.get("share_of_roofline"),
                            t.get("cold_seconds"),
                            (t["output_tok_s"] / hf64) if hf64 and t.get("output_tok_s") else t.get("error")]
                           for t in speed["throughput"]])
        if speed.get("ttft"):
            out += _table(["TTFT prompt", "seconds", "prefill tok/s", "first run s"],
                          [[speed["ttft"].get("prompt"), speed["ttft"].get("seconds"),
                            speed["ttft"].get("prefill_tok_s"), speed["ttft"].get("cold_seconds")]])
    hf_section = sections.get("hf", {})
    if hf_section.get("generate"):
        out += ["## transformers `generate` on the same shape and device (static cache, SDPA, greedy)", ""]
        out += _table(["batch", "in/out", "s", "output tok/s", "decode tok/s per sequence"],
                      [[g.get("batch"), f"{g.get('input')}/{g.get('output')}", g.get("seconds"),
                        g.get("output_tok_s"), g.get("decode_tok_s_per_seq") or g.get("error", "")[:80]]
                       for g in hf_section["generate"]])
    for name in [n for n in sections if n.startswith("decode")]:
        decode = sections.get(name, {})
        if decode.get("variants"):
            flags = decode.get("settings", {}).get("xla_flags")
            out += [f"## Batch-1 decode by burst length and smallest token bucket (XLA_FLAGS {flags!r})", ""]
            out += _table(["variant", "tok/s", "ms/token", "roofline ms", "share of roofline", "engine calls",
                           "device wait ms per call", "tokens = first variant's"],
                          [[v["variant"], v.get("tok_s"), v.get("ms_per_token"), v.get("roofline_ms"),
                            v.get("share_of_roofline"), v.get("engine_calls"), v.get("device_wait_ms_per_call"),
                            v.get("tokens_equal_first_variant")]
                           for v in decode["variants"]])
    gemm = sections.get("gemm", {})
    if gemm.get("matmuls"):
        out += ["## Decode GEMMs, Llama-3-8B weights (bf16, 8 rows), by XLA setting and Pallas tiling", ""]
        out += _table(["matrix", "shape", "variant", "µs", "GB/s", "share of HBM", "rel. error"],
                      [[m["matrix"], "x".join(map(str, m["shape"])), m["variant"], m.get("us"), m.get("gb_per_s"),
                        m.get("share_of_hbm"), m.get("rel_error", m.get("error", "")[:80])]
                       for m in gemm["matmuls"]])
    if gemm.get("decode_step_gemms"):
        out += _table(["variant", "one step's GEMMs ms", "GB/s", "share of HBM"],
                      [[name, v.get("step_ms"), v.get("gb_per_s"), v.get("share_of_hbm")]
                       for name, v in gemm["decode_step_gemms"].items()])
    out += ["## Sections", ""]
    out += _table(["section", "status", "seconds"],
                  [[name, s.get("status"), s.get("seconds")] for name, s in sections.items()])
    return "\n".join(out)
