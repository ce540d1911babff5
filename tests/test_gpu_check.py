"""The accelerator check (benchmarks/gpu_check) end to end on the CPU with the demo model: each section runs in its
own process and writes what the report reads; and the committed GPU results still render."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_check_runs_on_cpu_with_the_demo_model(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # parity and kernels are the tests' own comparisons (test_parity.py, test_kernels.py) run by other code paths.
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path), "--device", "cpu",
           "--sections", "env,speed,hf,warmup", "--concurrency", "2,4", "--io", "16/8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["status"] for k, s in sections.items()}
    assert sections["env"]["hbm_bandwidth"]["gb_per_s"] > 0 and sections["env"]["bf16_matmul"]["tflops"] > 0
    speed = sections["speed"]
    assert speed["batch1_decode"]["tok_s"] > 0 and 0 < speed["batch1_decode"]["share_of_roofline"]
    assert [(t["concurrent"], t["input"], t["output"]) for t in speed["throughput"]] == [(2, 16, 8), (4, 16, 8)]
    assert all(t["output_tok_s"] > 0 for t in speed["throughput"])
    assert sections["warmup"]["warmup"]["step_shapes"] >= len(sections["warmup"]["warmup"]["token_buckets"])
    assert [g["batch"] for g in sections["hf"]["generate"]] == [1, 4]
    report = (tmp_path / "gpu_check.md").read_text()
    assert "batch-1 decode tok/s" in report and "transformers `generate`" in report


def test_committed_gpu_results_render():
    from benchmarks.gpu_check.report import markdown

    result = json.loads((REPO / "docs" / "gpu" / "gpu_check_h200.json").read_text())
    report = markdown(result)
    assert "NVIDIA H200" in report
    assert all(family["ok"] for family in result["sections"]["parity"]["families"])
    assert all(case["ok"] for case in result["sections"]["kernels"]["correctness"])
    decode = json.loads((REPO / "docs" / "gpu" / "gpu_check_h200_decode.json").read_text())
    report = markdown(decode)
    assert "NVIDIA H200" in report and report.count("Batch-1 decode by burst length") == 2
    assert all(case["ok"] for case in decode["sections"]["kernels"]["correctness"])
