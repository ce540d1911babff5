"""The choice of executor: what `executor` and `attention_backend` pick on each platform, and the clear errors for
combinations that cannot run. (What each executor computes is checked against transformers in test_engine.py and
test_parity.py.)"""

from __future__ import annotations

import pytest

import cpu_kernels
from jserve.executors import CpuLayerExecutor, XlaExecutor, choose_executor

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here")


@needs_kernels
@pytest.mark.parametrize(("executor", "attention", "sharded", "want"), [
    ("auto", "auto", False, (CpuLayerExecutor, "cpu")),
    ("auto", "cpu", False, (CpuLayerExecutor, "cpu")),
    ("auto", "reference", False, (XlaExecutor, "reference")),
    ("auto", "pallas-interpret-gpu", False, (XlaExecutor, "pallas-interpret-gpu")),
    ("auto", "auto", True, (XlaExecutor, "cpu")),  # sharded: the XLA executor with the C++ attention kernel
    ("xla", "auto", False, (XlaExecutor, "cpu")),
    ("cpu-layers", "auto", True, (CpuLayerExecutor, "cpu")),
])
def test_auto_picks_the_cpu_layer_executor_only_where_it_runs_the_step(executor, attention, sharded, want):
    cls, backend, why = choose_executor(executor, attention, sharded=sharded, platform="cpu")
    assert (cls, backend) == want and why


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerators_run_the_xla_executor_with_the_pallas_kernel(platform):
    cls, backend, why = choose_executor("auto", "auto", platform=platform)
    assert (cls, backend) == (XlaExecutor, "pallas") and platform in why
    with pytest.raises(ValueError, match="CPU only"):
        choose_executor("cpu-layers", "auto", platform=platform)


@needs_kernels
def test_the_cpu_layer_executor_refuses_another_attention():
    with pytest.raises(ValueError, match="needs executor 'xla'"):
        choose_executor("cpu-layers", "reference", platform="cpu")
