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
    # parity is the tests' own comparison (test_parity.py) run by another code path; kernels runs one case and shape.
    # hf (transformers' generate) and quant (int8 and fp8 against bf16) ran on the H200 as they are; the sections
    # run here are those that changed since or have not run there yet.
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path), "--device", "cpu",
           "--sections", "env,kernels,speed,warmup,profile,lora", "--kernel-cases", "8/8/128/16/bfloat16",
           "--concurrency", "2", "--io", "16/8", "--max-num-batched-tokens", "64", "--profile-tokens", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["status"] for k, s in sections.items()}
    assert sections["env"]["hbm_bandwidth"]["gb_per_s"] > 0 and sections["env"]["bf16_matmul"]["tflops"] > 0
    speed = sections["speed"]
    assert speed["batch1_decode"]["tok_s"] > 0 and 0 < speed["batch1_decode"]["share_of_roofline"]
    assert [(t["concurrent"], t["input"], t["output"]) for t in speed["throughput"]] == [(2, 16, 8)]
    assert all(t["output_tok_s"] > 0 for t in speed["throughput"])
    assert sections["warmup"]["warmup"]["step_shapes"] >= len(sections["warmup"]["warmup"]["token_buckets"])
    # kernels: one correctness case; one decode shape timed, the kernel's loop traced (on a CPU the interpreted
    # kernel runs as XLA ops: all of its time is "other")
    kernels = sections["kernels"]
    assert [c["ok"] for c in kernels["correctness"]] == [True]
    (timing,) = kernels["decode_timing"]
    assert timing["pallas_us"] > 0 and timing["xla_gather_us"] > 0 and timing["pallas_searchsorted_loop_us"] > 0
    assert timing["pallas_traced_trace_source"]
    assert timing["pallas_traced_busy_us"] > 0 and timing["pallas_traced_other_us"] > 0
    # profile: one traced request on the CPU, XLA's thunks standing in for the device's kernels
    profile = sections["profile"]
    assert profile["run"]["model_steps"] >= 16 and profile["run"]["compiles_in_traced_run"] == 0
    host = profile["profile"]["host_xla_ops"]
    assert host["top"] and 0 < host["busy_us_per_token"] and profile["per_token"]["source"] == "host_xla_ops"
    # each heavy op named by the jax ops behind it, from XLA's optimized HLO: the model's matmuls among them
    assert all(isinstance(r["ops"], list) for r in host["top"])
    assert any("dot_general @ " in op for r in host["top"] for op in r["ops"]), [r["ops"] for r in host["top"]]
    assert not (tmp_path / "profile_trace").exists()
    # lora: one engine serving the base model and a random adapter written in PEFT's layout; the adapter's tokens
    # are the same alone and in a batch mixed with base-model requests, and not the base model's
    lora = sections["lora"]
    assert [(r["concurrent"], r["adapter"]) for r in lora["batch1_decode"] + lora["throughput"]] == \
        [(1, False), (1, True), (2, False), (2, True)]
    assert all(r.get("tok_s", r.get("output_tok_s", 0)) > 0 for r in lora["batch1_decode"] + lora["throughput"])
    assert lora["check"]["alone_equals_mixed"] and lora["check"]["differs_from_base"], lora["check"]
    report = (tmp_path / "gpu_check.md").read_text()
    assert "batch-1 decode tok/s" in report and "Where batch-1 decode time goes" in report
    assert "## LoRA (demo, a random rank-16 adapter on every projection" in report


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


# A GPU trace's shape as jax.profiler writes it: a device plane, a stream line of kernels, the derived XLA Ops line.
GPU_TRACE = """
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #7(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 stats { metadata_id: 1 str_value: "jit_burst" } }
    events { metadata_id: 2 offset_ps: 6000000 duration_ps: 1000000 stats { metadata_id: 1 str_value: "jit_burst" } }
    events { metadata_id: 4 offset_ps: 8000000 duration_ps: 2000000 stats { metadata_id: 1 str_value: "jit_burst" } }
    events { metadata_id: 2 offset_ps: 11000000 duration_ps: 1000000 stats { metadata_id: 1 str_value: "jit_sample" } }
  }
  lines { id: 2 name: "Stream #9(MemcpyD2D)" timestamp_ns: 1000
    events { metadata_id: 5 offset_ps: 4000000 duration_ps: 2000000 }
  }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 0 duration_ps: 7000000 }
  }
  lines { id: 4 name: "Steps" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 0 duration_ps: 12000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "nvjet_tst_64x8_64x8_1x1_v_bz_TNT" } }
  event_metadata { key: 2 value { id: 2 name: "loop_add_fusion" } }
  event_metadata { key: 3 value { id: 3 name: "fusion.3" } }
  event_metadata { key: 4 value { id: 4 name: "ragged_paged_attention_triton" } }
  event_metadata { key: 5 value { id: 5 name: "MemcpyD2D" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_module" } }
}
planes { id: 2 name: "/host:CPU" }
"""


def test_profile_sums_a_device_trace_by_kernel_and_category():
    from jax.profiler import ProfileData

    from benchmarks.gpu_check.profile import aggregate, category, collect
    from benchmarks.gpu_check.report import markdown

    assert [category(n) for n in ("sm90_xmma_gemm_bf16", "void cutlass::Kernel", "dot.3", "Memset",
                                  "ragged_paged_attention_triton", "loop_multiply_fusion.2")] == \
        ["gemm", "gemm", "gemm", "memcpy/memset", "attention", "fusion/elementwise"]
    kinds, seen = collect(ProfileData.from_text_proto(GPU_TRACE))
    assert set(kinds) == {"kernels", "xla_ops"}  # the Steps line is listed, not summed
    assert seen["lines"]["/device:GPU:0 Steps"] == 1 and len(kinds["kernels"]) == 2
    kernels = aggregate(kinds["kernels"], steps=2)
    assert kernels["events"] == 5 and kernels["distinct_names"] == 4
    # 11 µs of kernels over 2 steps; the copy overlaps the first kernel by 1 µs, so 10 µs busy
    assert kernels["self_us_per_token"] == 5.5 and kernels["busy_us_per_token"] == 5.0
    assert kernels["categories_us_per_token"] == {"gemm": 2.5, "attention": 1.0, "memcpy/memset": 1.0,
                                                  "fusion/elementwise": 1.0}
    top = kernels["top"]
    assert [r["name"] for r in top][0].startswith("nvjet") and top[0]["us_per_token"] == 2.5
    add = next(r for r in top if r["name"] == "loop_add_fusion")
    assert add["count"] == 2 and add["count_per_step"] == 1.0 and add["total_us"] == 2.0
    assert kernels["modules_us_per_token"] == {"jit_burst": 4.0, "jit_sample": 0.5}
    assert aggregate(kinds["kernels"], steps=2, top=1)["top"] == top[:1]
    report = markdown({"sections": {"profile": {"run": {"prompt": 128, "new_tokens": 2, "model_steps": 2,
                                                        "traced_wall_ms_per_step": 0.01},
                                                "profile": {"kernels": kernels}}}})
    assert "Where batch-1 decode time goes" in report and "| nvjet_tst_64x8" in report and "| 50.0% |" in report


def test_profile_self_time_subtracts_nested_events():
    from benchmarks.gpu_check.profile import aggregate, busy_ns, self_times

    # a while thunk of 10 ns holding two body thunks, then one after it; a line of its own with an overlapping event
    line = [("while.1", 0, 10, "m"), ("dot.1", 1, 3, "m"), ("fusion.1", 5, 4, "m"), ("fusion.1", 12, 2, "m")]
    assert self_times(line) == [3, 3, 4, 2]
    assert busy_ns([(0, 10), (12, 2), (13, 3), (1, 2)]) == 14
    agg = aggregate({"a": line, "b": [("copy", 9, 2, None)]}, steps=1)
    assert agg["self_us_per_token"] == 14e-3 and agg["busy_us_per_token"] == 13e-3
    assert {r["name"]: r["self_us"] for r in agg["top"]} == {"while.1": 3e-3, "dot.1": 3e-3, "fusion.1": 6e-3,
                                                             "copy": 2e-3}


# An optimized module as XLA dumps it (--xla_dump_hlo_as_text): source tables, then computations whose metadata
# points into them by stack_frame_id.
HLO_DUMP = """HloModule jit_burst, is_scheduled=true

FileNames
1 "/src/jserve/models/llama.py"
2 "/src/jserve/layers/norm.py"

FunctionNames
1 "rms_norm"

FileLocations
1 {file_name_id=2 function_name_id=1 line=31 end_line=31 column=4 end_column=20}
2 {file_name_id=1 function_name_id=1 line=88 end_line=88 column=4 end_column=20}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}


%fused_convert (param_0: bf16[8]) -> f32[8] {
  %param_0 = bf16[8]{0} parameter(0)
  %convert.3 = f32[8]{0} convert(%param_0), metadata={op_name="jit(burst)/body/convert_element_type" stack_frame_id=1}
  ROOT %mul.2 = f32[8]{0} multiply(%convert.3, %convert.3), metadata={op_name="jit(burst)/body/mul" stack_frame_id=1}
}

ENTRY %main.9 (Arg_0.1: bf16[8], Arg_1.2: bf16[8,8]) -> f32[8] {
  %Arg_0.1 = bf16[8]{0} parameter(0)
  %Arg_1.2 = bf16[8,8]{1,0} parameter(1)
  %loop_convert_fusion.32 = f32[8]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_convert
  ROOT %dot.5 = f32[8]{0} dot(%loop_convert_fusion.32, %Arg_1.2), lhs_contracting_dims={0}, \
rhs_contracting_dims={0}, metadata={op_name="jit(burst)/body/dot_general" source_file="/src/jserve/models/llama.py" \
source_line=90}
}
"""


def test_heavy_kernels_are_named_by_the_jax_ops_behind_them(tmp_path):
    """A GPU kernel's name (loop_convert_fusion_32) is its HLO instruction's (loop_convert_fusion.32): the ops fused
    into it, by frequency, with their source lines; an instruction's own metadata where it calls nothing."""
    from benchmarks.gpu_check.hlo_ops import sources

    (tmp_path / "module_0001.jit_burst.sm_9.0_gpu_after_optimizations.txt").write_text(HLO_DUMP)
    (tmp_path / "module_0001.jit_burst.before_optimizations.txt").write_text(HLO_DUMP.replace("dot.5", "dot.6"))
    found = sources(tmp_path, ["loop_convert_fusion_32", "dot.5", "dot.6", "nvjet_sm90_tss_64x8"])
    assert found == {"loop_convert_fusion_32": ["body/convert_element_type @ norm.py:31", "body/mul @ norm.py:31"],
                     "dot.5": ["body/dot_general @ llama.py:90"]}
