"""Section profile: where batch-1 decode's device time goes, kernel by kernel.

The decode section's engine in its default variant (bursts of 32 steps, 8 rows on a GPU; 8 steps, 8 rows on a
CPU) runs one request of 128 + N tokens (args["profile_tokens"], 64 by default) to compile, a second to time it
untraced, and a third, the same shape, under jax.profiler.trace. The trace (the *.xplane.pb the profiler writes) is
read back with jax.profiler.ProfileData. Its device planes ("/device:GPU:0") hold one line per CUDA stream
("Stream #..."), whose events are the kernels, and derived lines ("XLA Ops", "XLA Modules") whose events are the
HLO ops and executables the kernels ran for; each kind of line is summed by event name (count, total and self time,
self time per model step) and by category (gemm, attention, memcpy/memset, fusion/elementwise). Per model step:
the engine's step count over the traced request (its prompt step and each step of its decode bursts), so a
figure is what one decoded token costs, the prompt's one step of 128 tokens spread over them. Device-busy time is
the union of the kernel events' intervals: against the wall time a token takes, the rest is the GPU idle (launch
gaps, the host). On a CPU there are no device planes: the host plane's XLA thunk events (those with an hlo_op
stat, on XLA's worker threads) stand in, so the section runs end to end anywhere.

The profiled engine compiles its decode bursts without command buffers (a step's options, not
executors.xla.burst_compiler_options): the profiler records a CUDA graph's launch but not the kernels inside it,
and XLA keeps replaying a burst's graph (its while loop as conditional nodes) under the profiler, so a trace of the
engine's own bursts holds about one kernel in twenty (an H200 run: 20 kernel events a step of an 8B model, 5% of
the wall time). Without the graphs the host launches each kernel and tests each loop condition: the kernels'
durations hold, the gaps between them do not. Set against the untraced request's time a token, the device-busy
time shows what the GPU idles. args["profile_command_buffers"] (--profile-command-buffers) keeps the engine's graphs
and sets XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true, to time the gaps as they are (kernels inside
graphs then go untraced). A trace whose busy time is under half the wall time is flagged in trace["warning"].

Each of the heaviest events is named by the jax ops and source lines behind it (row["ops"]; hlo_ops.py), from
the optimized HLO XLA dumps for the run: the persistent compilation cache is off, so every module compiles (and is
dumped). The trace directory is deleted after parsing unless args["keep_trace"] (then it is OUT/profile_trace).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from benchmarks.gpu_check import hlo_ops
from benchmarks.gpu_check.common import model_dir, section_args, work_dir
from benchmarks.gpu_check.decode import VARIANTS, engine_settings, set_variant
from benchmarks.gpu_check.speed import run_requests, step_split

TOP = 40
GEMM_KEYS = ("gemm", "cublas", "cutlass", "sm90", "nvjet", "matmul", "dot")
ATTENTION_KEYS = ("attention", "ragged_paged")  # the Triton kernel is ragged_paged_attention_triton
CATEGORIES = ("gemm", "attention", "memcpy/memset", "fusion/elementwise")
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework Name Scope", "Framework Ops", "TensorFlow Name Scope",
                 "TensorFlow Ops", "Source code", "XLA TraceMe", "Launch Stats")
# An event: (name, start ns, duration ns, the hlo_module stat or None).
Event = tuple[str, float, float, "str | None"]


def category(name: str) -> str:
    lower = name.lower()
    if any(k in lower for k in ATTENTION_KEYS):
        return "attention"
    if any(k in lower for k in GEMM_KEYS):
        return "gemm"
    if "memcpy" in lower or "memset" in lower:
        return "memcpy/memset"
    return "fusion/elementwise"


def line_kind(name: str) -> str | None:
    """How a device plane's line is summed: "kernels" (a stream), "xla_ops", "xla_modules", or None (not summed)."""
    if name.startswith("Stream"):
        return "kernels"
    return {"XLA Ops": "xla_ops", "XLA Modules": "xla_modules"}.get(name)


def self_times(events: list[Event]) -> list[float]:
    """Each event's duration less the events nested inside it on the same line (a CPU while thunk encloses its
    body's thunks; a GPU stream's kernels do not nest, so there self time is the duration)."""
    own = [float(e[2]) for e in events]
    stack: list[int] = []
    for i in sorted(range(len(events)), key=lambda i: (events[i][1], -events[i][2])):
        start, end = events[i][1], events[i][1] + events[i][2]
        while stack and events[stack[-1]][1] + events[stack[-1]][2] <= start:
            stack.pop()
        if stack and end <= events[stack[-1]][1] + events[stack[-1]][2]:
            own[stack[-1]] -= events[i][2]
        stack.append(i)
    return own


def busy_ns(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, duration) intervals."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(intervals):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def aggregate(lines: dict[str, list[Event]], steps: int, top: int = TOP) -> dict:
    """Sum a kind's lines by event name: count, total and self µs, self µs per model step, category; the per-category
    and per-module self µs per step, the union of the events' intervals (busy µs) per step."""
    steps = max(steps, 1)
    by_name: dict[str, list[float]] = {}
    modules: dict[str, float] = {}
    for events in lines.values():
        for event, own in zip(events, self_times(events), strict=True):
            entry = by_name.setdefault(event[0], [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += event[2]
            entry[2] += own
            if event[3]:
                modules[event[3]] = modules.get(event[3], 0.0) + own
    categories = dict.fromkeys(CATEGORIES, 0.0)
    for name, (_, _, own) in by_name.items():
        categories[category(name)] += own / 1e3 / steps
    ranked = sorted(by_name.items(), key=lambda item: -item[1][2])
    rows = [{"name": name[:300], "category": category(name), "count": count, "count_per_step": count / steps,
             "total_us": total / 1e3, "self_us": own / 1e3, "us_per_token": own / 1e3 / steps}
            for name, (count, total, own) in ranked[:top]]
    busy = busy_ns((e[1], e[2]) for events in lines.values() for e in events)
    return {"lines": sorted(lines), "events": sum(len(e) for e in lines.values()), "distinct_names": len(by_name),
            "steps": steps, "busy_us_per_token": busy / 1e3 / steps,
            "self_us_per_token": sum(v[2] for v in by_name.values()) / 1e3 / steps,
            "categories_us_per_token": categories,
            "modules_us_per_token": {m: ns / 1e3 / steps for m, ns in sorted(modules.items(), key=lambda kv: -kv[1])},
            "top": rows}


def _stats(event) -> dict:
    try:
        return dict(event.stats)
    except Exception:  # a stat the binding cannot convert: the event still counts, without its module
        return {}


def collect(data) -> tuple[dict[str, dict[str, list[Event]]], dict]:
    """(kind -> line -> events, what the trace holds: its planes and each line's event count) of a ProfileData."""
    kinds: dict[str, dict[str, list[Event]]] = {}
    seen: dict = {"planes": [], "lines": {}}
    planes = list(data.planes)
    seen["planes"] = [p.name for p in planes]
    device = [p for p in planes if p.name.startswith("/device:")]
    for plane in device:
        lines = list(plane.lines)
        names = [line.name for line in lines]
        streams = any(line_kind(n) == "kernels" for n in names)
        for line in lines:
            key = f"{plane.name} {line.name}"
            events = []
            for e in line.events:
                stats = _stats(e)
                events.append((e.name, e.start_ns, e.duration_ns, stats.get("hlo_module")))
            seen["lines"][key] = len(events)
            # No stream lines (another tracer's naming): every line but the derived ones holds kernels.
            kind = line_kind(line.name) or (None if streams or line.name in DERIVED_LINES else "kernels")
            if kind and events:
                kinds.setdefault(kind, {})[key] = events
    if device:
        return kinds, seen
    # CPU: XLA's thunks on its worker threads, each event naming its HLO op and module.
    for plane in planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            key = f"{plane.name} {line.name}"
            events, ops = [], []
            for e in line.events:
                events.append(e)
                stats = _stats(e)
                if "hlo_op" in stats:
                    ops.append((e.name, e.start_ns, e.duration_ns, stats.get("hlo_module")))
            seen["lines"][key] = len(events)
            if ops:
                kinds.setdefault("host_xla_ops", {})[key] = ops
            elif line.name != "python":
                kinds.setdefault("host_events", {})[key] = [(e.name, e.start_ns, e.duration_ns, None) for e in events]
    if "host_xla_ops" in kinds:
        kinds.pop("host_events", None)
    return kinds, seen


def profiler_options():
    """Options for a trace of device work: no Python tracer (its calls would slow the host, and the device waiting
    on it), no HLO protos (a smaller trace; the names are in the events)."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    return options


def xplane_files(trace_dir: str | Path) -> list[str]:
    """The trace files (*.xplane.pb) jax.profiler.trace wrote under trace_dir."""
    return sorted(glob.glob(str(Path(trace_dir) / "plugins" / "profile" / "*" / "*.xplane.pb")))


def summarize(paths: list[str], steps: int) -> dict:
    """The trace files' kinds of lines, aggregated; what they hold."""
    from jax.profiler import ProfileData

    merged: dict[str, dict[str, list[Event]]] = {}
    seen: dict = {"files": [os.path.basename(p) for p in paths], "bytes": sum(os.path.getsize(p) for p in paths),
                  "planes": [], "lines": {}}
    for path in paths:
        kinds, found = collect(ProfileData.from_file(path))
        seen["planes"] += found["planes"]
        seen["lines"].update(found["lines"])
        for kind, lines in kinds.items():
            merged.setdefault(kind, {}).update(lines)
    return {"kinds": {kind: aggregate(lines, steps) for kind, lines in merged.items()}, "trace": seen}


def main() -> None:
    args, results = section_args()
    flags = hlo_ops.dump_flags(hlo_dir := tempfile.mkdtemp(prefix="gpu_check_hlo_"))
    if args.get("profile_command_buffers"):
        flags.append("--xla_enable_command_buffers_during_profiling=true")
    # read when the backend starts: before jax is imported
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *flags]))
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit compiles nothing, so dumps nothing
    from jax._src import dispatch

    from jserve import LLM
    from jserve.executors import xla as xla_executor

    on_gpu = jax.default_backend() == "gpu"
    if not args.get("profile_command_buffers"):  # read when the executor builds its burst: before the LLM
        xla_executor.burst_compiler_options = xla_executor.step_compiler_options
    path, load_format = model_dir(args["model"], work_dir())
    prompt, new_tokens = 128, int(args.get("profile_tokens", 64))
    settings = engine_settings(args, load_format, on_gpu, prompt, new_tokens)
    variant = args.get("profile_variant") or ("burst32_rows8" if on_gpu else "burst8_rows8")
    results.record("settings", {**settings, "model": args["model"], "variant": variant, "prompt": prompt,
                                "new_tokens": new_tokens, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                "burst_command_buffers": bool(args.get("profile_command_buffers"))})
    start = time.perf_counter()
    llm = LLM(str(path), warmup=False, **settings)
    engine = llm.engine
    jax.block_until_ready(engine.executor.params)
    load_seconds = time.perf_counter() - start
    set_variant(engine, *VARIANTS[variant])
    rng = np.random.default_rng(0)
    vocab = min(engine.model_config.vocab_size, 32000)
    # Distinct prompts of one shape (prefix caching would skip a repeated prompt's prefill).
    cold_prompt, timed_prompt, traced_prompt = (rng.integers(10, vocab, (1, prompt)).tolist() for _ in range(3))
    start = time.perf_counter()
    run_requests(llm, cold_prompt, new_tokens)
    cold = time.perf_counter() - start

    def decode_ms(outputs) -> float:
        m = outputs[0].metrics
        return 1e3 * (m["finished_time"] - m["first_token_time"]) / max(new_tokens - 1, 1)

    outputs, timed_seconds = run_requests(llm, timed_prompt, new_tokens)
    untraced_ms = decode_ms(outputs)
    compiles: list[str] = []
    counting = [False]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event)
        if counting[0] and event == dispatch.BACKEND_COMPILE_EVENT else None)
    keep = bool(args.get("keep_trace"))
    trace_dir = Path(results.path).parent / "profile_trace" if keep else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if keep:  # one run's trace, not an earlier one's beside it
        shutil.rmtree(trace_dir, ignore_errors=True)
    before = dataclasses.replace(engine.stats)
    counting[0] = True
    try:
        with jax.profiler.trace(str(trace_dir), profiler_options=profiler_options()):
            outputs, traced_seconds = run_requests(llm, traced_prompt, new_tokens)
        counting[0] = False
        split = step_split(before, engine.stats)
        steps = split["model_steps"]
        run = {"prompt": prompt, "new_tokens": new_tokens, "variant": variant, "load_seconds": load_seconds,
               "cold_seconds": cold, "untraced_seconds": timed_seconds, "untraced_decode_ms_per_token": untraced_ms,
               "traced_seconds": traced_seconds, "traced_decode_ms_per_token": decode_ms(outputs),
               "traced_wall_ms_per_step": 1e3 * traced_seconds / max(steps, 1),
               "compiles_in_traced_run": len(compiles), **split}
        results.record("run", run)
        paths = xplane_files(trace_dir)
        if not paths:
            raise RuntimeError(f"no *.xplane.pb under {trace_dir}")
        start = time.perf_counter()
        summary = summarize(paths, steps)
        summary["trace"]["parse_seconds"] = time.perf_counter() - start
        if keep:
            summary["trace"]["dir"] = str(trace_dir)
        if on_gpu and not any(p.startswith("/device:") for p in summary["trace"]["planes"]):
            summary["trace"]["warning"] = "no /device: plane: the GPU tracer (CUPTI) recorded nothing"
        results.record("trace", summary["trace"])
        for agg in summary["kinds"].values():  # the jax ops behind each heavy event, from the optimized HLO
            ops = hlo_ops.sources(hlo_dir, [row["name"] for row in agg["top"]])
            for row in agg["top"]:
                row["ops"] = ops.get(row["name"], [])
        results.record("profile", summary["kinds"])
        main_kind = next((k for k in ("kernels", "host_xla_ops", "host_events") if k in summary["kinds"]), None)
        if main_kind:
            agg = summary["kinds"][main_kind]
            busy_ms = agg["busy_us_per_token"] / 1e3
            if on_gpu and busy_ms < 0.5 * run["traced_wall_ms_per_step"]:
                summary["trace"]["warning"] = (f"the kernels traced are busy {busy_ms:.3g} of "
                                               f"{run['traced_wall_ms_per_step']:.3g} ms a step: kernels inside "
                                               "CUDA graphs go untraced")
                results.record("trace", summary["trace"])
            results.record("per_token", {"source": main_kind, "device_busy_us": agg["busy_us_per_token"],
                                         "self_us": agg["self_us_per_token"],
                                         "categories_us": agg["categories_us_per_token"],
                                         "wall_ms": run["traced_wall_ms_per_step"],
                                         "decode_ms_untraced": untraced_ms,
                                         "busy_share_of_wall": busy_ms / run["traced_wall_ms_per_step"],
                                         "busy_share_of_untraced_decode": busy_ms / untraced_ms})
    finally:
        shutil.rmtree(hlo_dir, ignore_errors=True)
        if not keep:
            shutil.rmtree(trace_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
