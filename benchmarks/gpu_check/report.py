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
        out += _table(["batch", "context", "Triton µs", "share of HBM", "traced: kernel µs", "traced: other µs",
                       "no split µs", "XLA gather µs", "XLA / Triton"],
                      [[t.get("batch"), t.get("context"), t.get("pallas_us"), t.get("pallas_share_of_hbm"),
                        t.get("pallas_traced_kernel_us"), t.get("pallas_traced_other_us"),
                        t.get("pallas_no_split_us"), t.get("xla_gather_us"), t.get("pallas_over_xla") or
                        t.get("error", "")[:80]] for t in kernels["decode_timing"]])
        tuned = [name[:-3] for name in kernels["decode_timing"][0] if name.endswith("_us")
                 and name not in ("pallas_us", "pallas_no_split_us", "xla_gather_us")
                 and not name.startswith("pallas_traced_")]
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
    out += _profile(sections.get("profile", {}))
    out += _quant(sections.get("quant", {}))
    out += _lora(sections.get("lora", {}))
    out += ["## Sections", ""]
    out += _table(["section", "status", "seconds"],
                  [[name, s.get("status"), s.get("seconds")] for name, s in sections.items()])
    return "\n".join(out)


def _us(value) -> str | None:
    if value is None:
        return None
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _share(value) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _name(name: str, width: int = 90) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= width else name[:width - 3] + "..."


def _profile(profile: dict) -> list[str]:
    """The profile section: per kind of trace line (kernels on a GPU's streams, its XLA ops and modules; XLA's thunks
    on a CPU), the time per model step by category, then each kind's heaviest events."""
    kinds, run = profile.get("profile"), profile.get("run", {})
    if not kinds:
        return []
    settings = profile.get("settings", {})
    out = [f"## Where batch-1 decode time goes: one traced request of {run.get('prompt')} + {run.get('new_tokens')} "
           f"tokens ({settings.get('model')}, {run.get('variant')}, {run.get('model_steps')} model steps; "
           f"µs per step)", ""]
    out += _table(["traced wall ms per step", "traced decode ms/token", "untraced decode ms/token", "engine calls",
                   "compiles in traced run", "trace MB"],
                  [[run.get("traced_wall_ms_per_step"), run.get("traced_decode_ms_per_token"),
                    run.get("untraced_decode_ms_per_token"), run.get("engine_calls"), run.get("compiles_in_traced_run"),
                    profile.get("trace", {}).get("bytes", 0) / 1e6]])
    wall_us = 1e3 * (run.get("traced_wall_ms_per_step") or 0) or None
    untraced_us = 1e3 * (run.get("untraced_decode_ms_per_token") or 0) or None
    categories = list(next(iter(kinds.values())).get("categories_us_per_token", {}))
    out += _table(["lines", "events per step", "busy µs", "share of traced wall", "share of untraced token",
                   "sum of self µs",
                   *[f"{c} µs" for c in categories]],
                  [[kind, k.get("events", 0) / max(k.get("steps", 1), 1), _us(k.get("busy_us_per_token")),
                    _share(k["busy_us_per_token"] / wall_us) if wall_us and k.get("busy_us_per_token") else None,
                    _share(k["busy_us_per_token"] / untraced_us) if untraced_us and k.get("busy_us_per_token")
                    else None,
                    _us(k.get("self_us_per_token")),
                    *[_us(k.get("categories_us_per_token", {}).get(c)) for c in categories]]
                   for kind, k in kinds.items()])
    if profile.get("trace", {}).get("warning"):
        out += [f"**{profile['trace']['warning']}**", ""]
    for kind, k in kinds.items():
        busy = k.get("busy_us_per_token") or None
        out += [f"Heaviest {len(k.get('top', []))} of {k.get('distinct_names')} {kind} by self time "
                f"({len(k.get('lines', []))} lines)", ""]
        out += _table(["name", "category", "count per step", "µs per step", "share of busy", "jax ops (source)"],
                      [[_name(r["name"]), r.get("category"), r.get("count_per_step"), _us(r.get("us_per_token")),
                        _share(r["us_per_token"] / busy) if busy and r.get("us_per_token") is not None else None,
                        "; ".join(r.get("ops") or []) or None]
                       for r in k.get("top", [])])
        modules = k.get("modules_us_per_token") or {}
        if modules and kind != "xla_modules":
            out += _table(["module", "self µs per step"], [[_name(m), _us(v)] for m, v in list(modules.items())[:10]])
    return out


def _quant(quant: dict) -> list[str]:
    """The quant section: each weight / KV setting's agreement with bf16 weights and K/V, and its batch-1 decode."""
    rows, settings = quant.get("rows"), quant.get("settings", {})
    if not rows:
        return []
    ref = quant.get("reference_logits", {})
    out = [f"## Quantization against bf16 ({settings.get('model')}, attention {settings.get('attention_backend')}): "
           f"{settings.get('prompts')} prompts of {settings.get('prompt_len')} tokens, greedy "
           f"{settings.get('greedy_tokens')} new; batch-1 decode of {settings.get('speed_prompt')} + "
           f"{settings.get('new_tokens')} tokens", "",
           f"bf16 first-step logits: max |logit| {_fmt(ref.get('max_abs'))}, std {_fmt(ref.get('std'))}, median "
           f"top-2 margin {_fmt(ref.get('top2_margin_median'))}"
           + (" (dummy weights: greedy agreement is loose)." if settings.get("load_format") == "dummy" else "."), ""]
    base = next((r for r in rows if r.get("setting") == "bf16" and r.get("tok_s")), {})

    def cell(r: dict, key: str):
        return r.get(key) if r.get("status") == "ok" else None

    out += _table(["setting", "status", "first-step max abs dlogit", "first argmax equal", "tokens before divergence",
                   "identical streams", "weight GB", "GB read a token", "ms/token", "x bf16 tok/s", "roofline ms",
                   "share of roofline", "load s", "first run s"],
                  [[r.get("setting"), r.get("status") if r.get("status") != "error" else r.get("error", "")[:80],
                    cell(r, "max_abs_logit_diff"),
                    f"{r['first_argmax_equal']}/{r.get('streams')}" if "first_argmax_equal" in r else None,
                    cell(r, "tokens_before_first_divergence"),
                    f"{r['identical_streams']}/{r.get('streams')}" if "identical_streams" in r else None,
                    r["weight_bytes"] / 1e9 if r.get("weight_bytes") else None,
                    r["bytes_per_token"] / 1e9 if r.get("bytes_per_token") else None, cell(r, "ms_per_token"),
                    r["tok_s"] / base["tok_s"] if base and r.get("tok_s") else None, cell(r, "roofline_ms"),
                    cell(r, "share_of_roofline"), cell(r, "load_seconds"), cell(r, "cold_seconds")] for r in rows])
    return out


def _lora(lora: dict) -> list[str]:
    """The lora section: the base model's and the adapter's batch-1 decode and throughput on one engine."""
    if not lora.get("batch1_decode"):
        return []
    settings, check = lora.get("settings", {}), lora.get("check", {})
    out = [f"## LoRA ({settings.get('model')}, a random rank-{settings.get('rank')} adapter on every projection, "
           f"attention {settings.get('attention_backend')})", ""]
    base = {(r["concurrent"], r.get("input")): r for r in lora["batch1_decode"] + lora.get("throughput", [])
            if not r["adapter"]}

    def rate(r: dict):
        return r.get("tok_s", r.get("output_tok_s"))

    out += _table(["requests", "in/out", "on", "tok/s", "x base", "s", "first run s", "host ms per call"],
                  [[r["concurrent"], f"{r['input']}/{r['output']}", "adapter" if r["adapter"] else "base", rate(r),
                    rate(r) / rate(base[(r["concurrent"], r["input"])])
                    if r["adapter"] and (r["concurrent"], r["input"]) in base else None,
                    r["seconds"], r["cold_seconds"], r.get("host_ms_per_call")]
                   for r in lora["batch1_decode"] + lora.get("throughput", [])])
    if check:
        out += ["", f"Adapter tokens alone = in a batch mixed with base requests: {check.get('alone_equals_mixed')}; "
                    f"differ from the base model's: {check.get('differs_from_base')}.", ""]
    return out
