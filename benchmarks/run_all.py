"""Run the whole comparison (jserve against llama.cpp and transformers) and write a report of it.

    python benchmarks/run_all.py [--build-llama-cpp] [--quick] [--work-dir DIR] [--output FILE]

The report (markdown, with a plot of the bfloat16 serving run beside it) goes to --output, by default
benchmarks.md in --work-dir; docs/benchmarks.md is the curated page of current results, which a run does not touch.

Run it on a quiet machine: every figure is a timing. Steps, each recorded with its exact command line:
  1. build the 135M-shaped model (build_bench_model.py) and, where llama.cpp is built, its f32 and bf16 GGUFs
  2. batch-1 latency: `jserve bench latency` per dtype (with the roofline), llama-bench per dtype
  3. online serving: `jserve bench serve` at 1, 8 and 32 concurrent (128-token prompts and outputs) against
     `jserve serve` and `llama-server -np 32`, per dtype
  4. offline throughput on the ShareGPT-like mix: `jserve bench throughput` per dtype, and transformers'
     static batching per dtype and batch size
  5. start-up: cold (empty compilation cache) and warm (persistent cache) warm-up
  6. prefix caching: TTFT with a shared 1,024-token prefix, with and without the prefix cache
llama.cpp is optional: without a build (--build-llama-cpp, or --llama-cpp-dir) its rows are left out.
--quick shrinks every workload to seconds, to check the script itself; its figures mean nothing.
See benchmarks/README.md for the llama.cpp procedure this script automates.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = Path("~/.cache/jserve").expanduser()
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp is built
DTYPES = {"float32": "f32", "bfloat16": "bf16"}  # jserve dtype -> llama.cpp GGUF type
PY = sys.executable


@dataclasses.dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompts_per_slot: int = 4  # serve: num_prompts = concurrency * this (at least 16)
    serve_len: int = 128
    offline_dataset: tuple[str, ...] = ("--dataset", "mixed", "--num-prompts", "256")
    hf_batch_sizes: tuple[int, ...] = (8, 32, 64)
    latency_len: int = 128
    latency_iters: int = 10
    prefix_len: int = 1024
    prefix_prompts: int = 16
    engine_flags: tuple[str, ...] = ()  # added to every jserve engine (server, latency, throughput)


QUICK = Plan(concurrency=(1, 2), prompts_per_slot=2, serve_len=8,
             offline_dataset=("--dataset", "random", "--num-prompts", "4", "--random-input-len", "16",
                              "--random-output-len", "8"),
             hf_batch_sizes=(2,), latency_len=8, latency_iters=1, prefix_len=64, prefix_prompts=4,
             engine_flags=("--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"))


class Runner:
    """Runs commands, logs them, and remembers each command line for the report."""

    def __init__(self, work: Path):
        self.work = work
        self.commands: list[str] = []

    def run(self, cmd: list[str], log: str) -> None:
        self.commands.append(shlex.join(cmd))
        print("+", shlex.join(cmd), flush=True)
        with open(self.work / f"{log}.log", "w") as out:
            subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def output(self, cmd: list[str], log: str) -> str:
        """stdout of the command (its stderr goes to the log)."""
        self.commands.append(shlex.join(cmd))
        print("+", shlex.join(cmd), flush=True)
        with open(self.work / f"{log}.log", "w") as err:
            return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=err, cwd=REPO, text=True).stdout

    def json(self, cmd: list[str], name: str) -> dict:
        path = self.work / f"{name}.json"
        self.run(cmd + ["--result-json", str(path)], name)
        return json.loads(path.read_text())

    @contextlib.contextmanager
    def server(self, cmd: list[str], port: int, name: str, timeout: float = 900) -> Iterator[str]:
        """A server process until the block ends; yields its base URL once GET /health answers 200."""
        self.commands.append(shlex.join(cmd))
        print("+", shlex.join(cmd), "&", flush=True)
        log = open(self.work / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, url, timeout)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {timeout} s")


# ----- llama.cpp -----


def build_llama_cpp(runner: Runner, root: Path) -> Path:
    """pip download the llama-cpp-python sdist and build llama-server and llama-bench from its llama.cpp."""
    build = root / "build"
    if (build / "bin" / "llama-server").is_file() and (build / "bin" / "llama-bench").is_file():
        return build / "bin"
    root.mkdir(parents=True, exist_ok=True)
    runner.run([PY, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(root),
                f"llama-cpp-python=={LLAMA_CPP_VERSION}"], "llama-cpp-download")
    with tarfile.open(root / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as tar:
        tar.extractall(root, filter="data")
    source = llama_cpp_source(root)
    runner.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"], "llama-cpp-cmake")
    runner.run(["cmake", "--build", str(build), "--target", "llama-server", "llama-bench", "-j",
                str(os.cpu_count() or 2)], "llama-cpp-build")
    return build / "bin"


def llama_cpp_source(root: Path) -> Path:
    return root / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"


def convert_ggufs(runner: Runner, root: Path, model: Path) -> dict[str, Path]:
    """f32 and bf16 GGUFs made by llama.cpp's own converter from the same safetensors jserve loads."""
    ggufs = {}
    for dtype, kind in DTYPES.items():
        out = model.parent / f"{model.name}-{kind}.gguf"
        if not out.is_file():
            runner.run([PY, str(HERE / "convert_gguf.py"), str(llama_cpp_source(root)), str(model), "--outtype",
                        kind, "--outfile", str(out)], f"convert-{kind}")
        ggufs[dtype] = out
    return ggufs


def llama_bench(runner: Runner, bin_dir: Path, gguf: Path, plan: Plan, name: str) -> dict:
    rows = json.loads(runner.output([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(plan.latency_len),
                                     "-n", str(plan.latency_len), "-t", str(os.cpu_count() or 2), "-o", "json"],
                                    name))
    return {"prefill_tokens_per_s": next(r["avg_ts"] for r in rows if r["n_gen"] == 0),
            "decode_tokens_per_s": next(r["avg_ts"] for r in rows if r["n_prompt"] == 0)}


# ----- the benchmarks -----


def jserve_server_cmd(model: Path, dtype: str, port: int, plan: Plan, *extra: str) -> list[str]:
    return [PY, "-m", "jserve", "serve", "--model", str(model), "--dtype", dtype, "--port", str(port),
            "--served-model-name", "bench", *plan.engine_flags, *extra]


def serve_bench(runner: Runner, url: str, model: Path, plan: Plan, conc: int, name: str, *extra: str) -> dict:
    return runner.json([PY, "-m", "jserve", "bench", "serve", "--base-url", url, "--tokenizer", str(model),
                        "--dataset", "random", "--random-input-len", str(plan.serve_len), "--random-output-len",
                        str(plan.serve_len), "--num-prompts", str(max(16, conc * plan.prompts_per_slot)),
                        "--max-concurrency", str(conc), "--ignore-eos", "--disable-tqdm", *extra], name)


def latency_section(runner: Runner, model: Path, plan: Plan, llama: tuple[Path, dict] | None) -> dict:
    out = {}
    for dtype in DTYPES:
        out[f"jserve-{dtype}"] = runner.json(
            [PY, "-m", "jserve", "bench", "latency", "--model", str(model), "--dtype", dtype, "--input-len",
             str(plan.latency_len), "--output-len", str(plan.latency_len), "--num-iters", str(plan.latency_iters),
             *plan.engine_flags],
            f"latency-jserve-{dtype}")
        if llama:
            out[f"llama.cpp-{dtype}"] = llama_bench(runner, llama[0], llama[1][dtype], plan, f"latency-llama-{dtype}")
    return out


def kv_cache_bytes(model: Path, dtype: str, tokens: int) -> int:
    """Bytes of a KV cache of `tokens` tokens at `dtype`: K and V of every layer."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"bfloat16": 2, "float32": 4}[dtype]
    return tokens * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width


def serving_section(runner: Runner, model: Path, plan: Plan, llama: tuple[Path, dict] | None) -> dict:
    out: dict[str, dict] = {}
    top = max(plan.concurrency)
    context = top * 2 * (plan.serve_len + 64)  # llama-server's -c; jserve's KV cache holds as many tokens
    for dtype, kind in DTYPES.items():
        kv = ("--kv-cache-memory-bytes", str(kv_cache_bytes(model, dtype, context)))
        with runner.server(jserve_server_cmd(model, dtype, 8301, plan, *kv), 8301, f"server-jserve-{dtype}") as url:
            for conc in plan.concurrency:
                plot = ["--plot", str(runner.work / f"serve-jserve-{dtype}.png")] if conc == top else []
                out[f"jserve-{dtype}-c{conc}"] = serve_bench(runner, url, model, plan, conc,
                                                             f"serve-jserve-{dtype}-c{conc}", *plot)
        if llama:
            cmd = [str(llama[0] / "llama-server"), "-m", str(llama[1][dtype]), "--port", "8302", "-np", str(top),
                   "-c", str(context), "-t", str(os.cpu_count() or 2)]
            with runner.server(cmd, 8302, f"server-llama-{kind}") as url:
                for conc in plan.concurrency:
                    out[f"llama.cpp-{dtype}-c{conc}"] = serve_bench(runner, url, model, plan, conc,
                                                                    f"serve-llama-{dtype}-c{conc}")
    return out


def offline_section(runner: Runner, model: Path, plan: Plan) -> dict:
    out = {}
    base = [PY, "-m", "jserve", "bench", "throughput", "--model", str(model), *plan.offline_dataset,
            *plan.engine_flags, "--disable-tqdm"]
    for dtype in DTYPES:
        out[f"jserve-{dtype}"] = runner.json(base + ["--dtype", dtype], f"offline-jserve-{dtype}")
        for bs in plan.hf_batch_sizes:
            out[f"hf-{dtype}-b{bs}"] = runner.json(base + ["--backend", "hf", "--hf-dtype", dtype,
                                                           "--hf-batch-size", str(bs)], f"offline-hf-{dtype}-b{bs}")
    return out


def startup_section(runner: Runner, model: Path, plan: Plan) -> dict:
    """Start-up of the same engine with an empty, then a filled, persistent compilation cache."""
    cache = runner.work / "xla-cache"
    cmd = [PY, "-m", "jserve", "bench", "throughput", "--model", str(model), "--dtype", "bfloat16", "--dataset",
           "random", "--num-prompts", "2", "--random-input-len", "16", "--random-output-len", "4",
           "--compilation-cache-dir", str(cache), *plan.engine_flags, "--disable-tqdm"]
    shutil.rmtree(cache, ignore_errors=True)
    cold = runner.json(cmd, "startup-cold")["startup_s"]
    return {"cold": cold, "warm": runner.json(cmd, "startup-warm")["startup_s"]}


def prefix_section(runner: Runner, model: Path, plan: Plan) -> dict:
    out = {}
    dataset = ["--dataset", "prefix-repetition", "--prefix-repetition-prefix-len", str(plan.prefix_len),
               "--prefix-repetition-suffix-len", "16", "--prefix-repetition-num-prefixes", "1",
               "--prefix-repetition-output-len", "16", "--num-prompts", str(plan.prefix_prompts),
               "--max-concurrency", "1", "--disable-tqdm"]
    for label, flag in (("cached", "--enable-prefix-caching"), ("cold", "--no-enable-prefix-caching")):
        cmd = jserve_server_cmd(model, "bfloat16", 8303, plan, flag)
        with runner.server(cmd, 8303, f"server-prefix-{label}") as url:
            out[label] = runner.json([PY, "-m", "jserve", "bench", "serve", "--base-url", url, "--tokenizer",
                                      str(model), "--ignore-eos", *dataset], f"prefix-{label}")
    return out


# ----- the report -----


def machine() -> dict:
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "os": platform.platform(), "python": platform.python_version(),
            "versions": {p: version(p) for p in ("jax", "jaxlib", "torch", "transformers")},
            "commit": commit.stdout.strip() or "unknown"}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _ms(report: dict) -> str:
    return f"{report['median_ttft_ms']:.0f} ms" if report else "n/a"


def _table(header: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows], ""]


def latency_lines(lat: dict) -> list[str]:
    rows = []
    for key, r in lat.items():
        roof = r.get("roofline_decode_tokens_per_s")
        rows.append([key, r["prefill_tokens_per_s"], r["decode_tokens_per_s"], roof or "",
                     f"{r['decode_tokens_per_s'] / roof:.0%}" if roof else ""])
    return ["## Batch-1 latency", "", *_table(["system", "prefill tok/s", "decode tok/s", "roofline tok/s",
                                               "of roofline"], rows)]


def serving_lines(serve: dict) -> list[str]:
    rows = [[key, r["completed"], r["output_throughput"], r["median_ttft_ms"], r["p99_ttft_ms"],
             r["median_tpot_ms"], r["p99_tpot_ms"], r["median_itl_ms"]] for key, r in serve.items()]
    return ["## Online serving (random prompts, streaming, EOS ignored)", "",
            *_table(["system-dtype-concurrency", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                     "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms"], rows)]


def offline_lines(offline: dict) -> list[str]:
    rows = [[key, r["num_requests"], r["output_tokens_per_s"], r["total_tokens_per_s"], r["requests_per_s"],
             r["startup_s"]] for key, r in offline.items()]
    return ["## Offline throughput", "", *_table(["system", "requests", "output tok/s", "total tok/s", "req/s",
                                                  "start-up s"], rows)]


def summary_lines(res: dict, top: int) -> list[str]:
    lat, serve, off = res["latency"], res["serving"], res["offline"]
    lines = ["## Targets (issue 7)", ""]
    for dtype in DTYPES:
        j = lat[f"jserve-{dtype}"]
        llama = lat.get(f"llama.cpp-{dtype}", {}).get("decode_tokens_per_s")
        lines.append(f"- batch-1 decode, {dtype}: {j['decode_fraction_of_roofline']:.0%} of the roofline "
                     f"(target >= 90%); {_ratio(j['decode_tokens_per_s'], llama)} llama.cpp (target > 1x)")
        js, ls = serve.get(f"jserve-{dtype}-c{top}", {}), serve.get(f"llama.cpp-{dtype}-c{top}", {})
        lines.append(f"- serving at {top} concurrent, {dtype}: output throughput "
                     f"{_ratio(js.get('output_throughput'), ls.get('output_throughput'))} llama.cpp (target "
                     f"{'1.5x' if dtype == 'bfloat16' else '1.2x'}); TTFT p50 {_ms(js)} vs {_ms(ls)}")
    best = lambda prefix: max((r["output_tokens_per_s"] for k, r in off.items() if k.startswith(prefix)), default=None)
    lines.append(f"- offline mix: best jserve {_ratio(best('jserve'), best('hf'))} best transformers (target >= 3x)")
    lines.append(f"- start-up: cold {res['startup']['cold']:.1f} s (target <= 60), warm cache "
                 f"{res['startup']['warm']:.1f} s (target <= 15)")
    cached, cold = res["prefix"]["cached"]["median_ttft_ms"], res["prefix"]["cold"]["median_ttft_ms"]
    lines += [f"- shared-prefix TTFT p50: {cached:.0f} ms cached vs {cold:.0f} ms without the prefix cache "
              f"= {cached / cold:.0%} (target <= 25%)", ""]
    return lines


def render(res: dict, plot: str | None, top: int) -> str:
    info = res["machine"]
    lines = ["# Benchmarks", "", "Written by `benchmarks/run_all.py`; do not edit by hand.", ""]
    if res["quick"]:
        lines += ["**--quick run: tiny workloads to check the script; these figures mean nothing.**", ""]
    lines += [f"- date: {res['date']}", f"- machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
              f"{info['os']}", f"- software: Python {info['python']}, " + ", ".join(
                  f"{k} {v}" for k, v in info["versions"].items()) + f"; jserve commit {info['commit']}",
              "- model: 135M-shaped Llama with random weights (benchmarks/build_bench_model.py)",
              f"- llama.cpp: {'llama-cpp-python ' + LLAMA_CPP_VERSION + ' sdist' if res['llama_cpp'] else 'not run'}",
              ""]
    lines += summary_lines(res, top)
    lines += latency_lines(res["latency"]) + serving_lines(res["serving"]) + offline_lines(res["offline"])
    if plot:
        lines += [f"![jserve bench serve, bfloat16, {top} concurrent]({plot})", ""]
    lines += ["## Commands", "", "In order; paths are this machine's. The llama.cpp build is described in "
              "benchmarks/README.md.", "", "```", *res["commands"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=CACHE / "bench-135m")
    parser.add_argument("--llama-cpp-dir", type=Path, default=CACHE / "llama.cpp",
                        help="where the llama.cpp sdist is unpacked and built")
    parser.add_argument("--build-llama-cpp", action="store_true", help="download and build it if it is not built")
    parser.add_argument("--work-dir", type=Path, default=CACHE / "bench-run", help="logs and result JSON files")
    parser.add_argument("--output", type=Path, help="the report (default: benchmarks.md in --work-dir)")
    parser.add_argument("--quick", action="store_true", help="tiny workloads, to check the script only")
    parser.add_argument("--render-only", action="store_true",
                        help="only rewrite --output from the results already in --work-dir")
    args = parser.parse_args(argv)
    args.output = args.output or args.work_dir / "benchmarks.md"
    if args.render_only:
        write_report(args.work_dir, args.output)
        return 0
    plan = QUICK if args.quick else Plan()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.work_dir)
    runner.run([PY, str(HERE / "build_bench_model.py"), str(args.model_dir)], "build-model")
    bin_dir = args.llama_cpp_dir / "build" / "bin"
    if args.build_llama_cpp:
        bin_dir = build_llama_cpp(runner, args.llama_cpp_dir)
    llama = (bin_dir, convert_ggufs(runner, args.llama_cpp_dir, args.model_dir)) \
        if (bin_dir / "llama-server").is_file() else None
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "llama_cpp": llama is not None,
           "quick": args.quick, "machine": machine(),
           "latency": latency_section(runner, args.model_dir, plan, llama),
           "serving": serving_section(runner, args.model_dir, plan, llama),
           "offline": offline_section(runner, args.model_dir, plan),
           "startup": startup_section(runner, args.model_dir, plan),
           "prefix": prefix_section(runner, args.model_dir, plan), "commands": runner.commands}
    (args.work_dir / "all.json").write_text(json.dumps(res, indent=2) + "\n")
    write_report(args.work_dir, args.output)
    return 0


def write_report(work_dir: Path, output: Path) -> None:
    """The report (and its plot) from the results a run left in work_dir."""
    res = json.loads((work_dir / "all.json").read_text())
    output.parent.mkdir(parents=True, exist_ok=True)
    plot = _copy_plot(work_dir / "serve-jserve-bfloat16.png", output)
    plan = QUICK if res["quick"] else Plan()
    output.write_text(render(res, plot, max(plan.concurrency)))
    print(f"wrote {output}")


def _copy_plot(png: Path, output: Path) -> str | None:
    if not png.is_file():
        return None
    target = output.with_name(output.stem + "-serve.png")
    target.write_bytes(png.read_bytes())
    return target.name


if __name__ == "__main__":
    sys.exit(main())
