"""benchmarks/stream_sim.cc (the weight-stream simulation docs/benchmarks.md cites) builds and runs every layout."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import cpu_kernels

SOURCE = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_sim.cc"
LINE = re.compile(r"(\S+) barriers=(\d): (fast|slow) state, (\d+) rounds: plain read ([\d.]+) GB/s, "
                  r"pass ([\d.]+) GB/s, ratio ([\d.]+), waits ([\d.]+) / ([\d.]+) ms")


@pytest.fixture(scope="module")
def stream_sim(tmp_path_factory) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None or not cpu_kernels.available():  # it needs what the CPU kernels need: a compiler, AVX2
        pytest.skip(cpu_kernels.unavailable_reason() or "no C++ compiler")
    binary = tmp_path_factory.mktemp("stream_sim") / "stream_sim"
    subprocess.run([compiler, "-O2", "-march=native", "-std=c++17", "-pthread", str(SOURCE), "-o", str(binary)],
                   check=True, capture_output=True)
    return binary


@pytest.mark.parametrize("layout", ["guided", "halves", "steal", "per-thread", "zigzag"])
def test_every_layout_reads_the_whole_model(stream_sim, layout):
    result = subprocess.run([str(stream_sim), layout, "1", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [LINE.search(line) for line in result.stdout.splitlines()]
    assert lines and all(lines), result.stdout
    assert sum(int(m.group(4)) for m in lines) == 2  # every round lands in one of the two buckets
    for m in lines:
        assert m.group(1).endswith(layout) and m.group(2) == "1"
        # bandwidths in GB/s; the ratio is the median of each round's own, so it need not equal pass / plain read
        assert all(float(m.group(g)) > 0 for g in (5, 6, 7))


def test_an_unknown_layout_is_refused(stream_sim):
    result = subprocess.run([str(stream_sim), "diagonal", "1", "2"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown layout diagonal" in result.stderr
