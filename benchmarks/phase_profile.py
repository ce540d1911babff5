"""Where a batch-1 decode token's time goes: the CPU kernels' phase profile (cpu_kernels.profile_phases) over greedy
generations, each after a read of the memory's bandwidth, summarised apart for the fast and the slow state.

    python benchmarks/phase_profile.py --model ~/.cache/jserve/bench-135m --dtype bfloat16 [--quantization int8]

Per token and per layer it prints each kind of layer phase's time running items and waiting for the other thread
(per worker: 0 is the thread that called the kernel), each matmul's weight bytes over its running time as a share
of the bandwidth read before the generation (over as many bytes as a token reads), and the time in each kernel and
outside them (XLA's ops between the calls and the host). A generation's prompt step is counted with its tokens, so
the figures are for this prompt and --tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import cpu_kernels
from jserve import LLM, SamplingParams
from jserve.bench.roofline import decode_bytes_per_token, last_level_cache_bytes, stream_buffer_bytes


def matrix_bytes(cfg, dtype: str, quantization: str | None = None) -> dict[str, float]:
    """Weight bytes of each kind of layer matmul, one layer (int8: a byte a weight; the scales left out)."""
    size = 1 if quantization == "int8" else {"float32": 4, "bfloat16": 2}[dtype]
    e, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"qkv": e * (q + 2 * kv) * size, "o": q * e * size, "gate_up": 2 * e * i * size, "down": i * e * size}


def one_generation(llm: LLM, params: SamplingParams, num_layers: int, buffer_bytes: int) -> dict:
    bandwidth = cpu_kernels.read_bandwidth(buffer_bytes, repeats=2)
    cpu_kernels.profile_phases(True)
    start = time.perf_counter()
    llm.generate(["hello world"], params)
    seconds = time.perf_counter() - start
    profile = cpu_kernels.phase_profile()
    cpu_kernels.profile_phases(False)
    tokens = max(1, profile.calls["decoder_layers"].count)  # one layer call a model step
    per_layer = tokens * num_layers

    def per_token(field: str) -> dict[str, float]:
        return {name: getattr(c, field) * 1e6 / tokens for name, c in profile.calls.items()}

    return {"bandwidth": bandwidth, "tok_s": params.max_tokens / seconds,
            "busy_us": profile.busy_s * 1e6 / per_layer, "wait_us": profile.wait_s * 1e6 / per_layer,
            "call_us": per_token("seconds"), "before_us": per_token("before_phases_s"),
            "after_us": per_token("after_phases_s"), "token_us": seconds * 1e6 / tokens}


def report(name: str, rows: list[dict], cfg, dtype: str, quantization: str | None) -> None:
    if not rows:
        print(f"\n{name}: no generations")
        return
    med = statistics.median
    bandwidth = med(r["bandwidth"] for r in rows)
    print(f"\n{name}: {len(rows)} generations, median {med(r['tok_s'] for r in rows):.1f} tok/s, "
          f"bandwidth read before them {bandwidth / 1e9:.1f} GB/s (median)")
    workers = min(r["busy_us"].shape[0] for r in rows)
    print("us per layer        " + "".join(f"  run w{w}  wait w{w}" for w in range(workers)) + "  bytes/run/bandwidth")
    sizes = matrix_bytes(cfg, dtype, quantization)
    for k, kind in enumerate(cpu_kernels.PHASE_KINDS):
        if kind == "other":  # the LM head's and argmax's phases: not the layers'
            continue
        busy = [med(r["busy_us"][w, k] for r in rows) for w in range(workers)]
        wait = [med(r["wait_us"][w, k] for r in rows) for w in range(workers)]
        if max(busy + wait) < 0.005:
            continue
        share = ""
        if kind in sizes:  # each worker streams its share of the matrix in its running time
            shares = [sizes[kind] / (r["busy_us"][:workers, k].max() * 1e-6) / r["bandwidth"] for r in rows]
            share = f"  {med(shares):.2f}"
        print(f"  {kind:17s}" + "".join(f"  {b:6.2f}  {w:7.2f}" for b, w in zip(busy, wait, strict=True)) + share)
    calls = {k: med(r["call_us"][k] for r in rows) for k in rows[0]["call_us"]}
    token = med(r["token_us"] for r in rows)
    before = {k: med(r["before_us"][k] for r in rows) for k in rows[0]["before_us"]}
    after = {k: med(r["after_us"][k] for r in rows) for k in rows[0]["after_us"]}
    print("us per token: " + ", ".join(f"{k} {v:.0f} ({before[k]:.0f} before its phases, {after[k]:.0f} after)"
                                       for k, v in calls.items() if v > 0)
          + f"; outside the kernels {token - sum(calls.values()):.0f}; the token {token:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--quantization", choices=["int8"], default=None)
    parser.add_argument("--fast-gb-s", type=float, default=50.0,
                        help="a generation is in the fast state when the bandwidth read before it is above this")
    args = parser.parse_args()

    cpu_kernels.profile_phases(False)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    cfg = llm.engine.model_config
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    llm.generate(["hello world"], params)  # warm
    # The bandwidth is read over as many bytes as a token reads (the roofline's buffer: jserve bench latency).
    buffer_bytes = stream_buffer_bytes(decode_bytes_per_token(cfg, args.dtype, args.tokens / 2,
                                                              quantization=args.quantization),
                                       last_level_cache_bytes())
    rows, end = [], time.time() + args.seconds
    while time.time() < end:
        rows.append(one_generation(llm, params, cfg.num_layers, buffer_bytes))
        r = rows[-1]
        print(f"{r['bandwidth'] / 1e9:5.1f} GB/s  {r['tok_s']:6.1f} tok/s", flush=True)
    threshold = args.fast_gb_s * 1e9
    for name, fast in (("fast state", True), ("slow state", False)):
        report(name, [r for r in rows if (r["bandwidth"] > threshold) == fast], cfg, args.dtype, args.quantization)


if __name__ == "__main__":
    main()
