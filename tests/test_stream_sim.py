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


def build(directory: Path, *switches: str) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None or not cpu_kernels.available():  # it needs what the CPU kernels need: a compiler, AVX2
        pytest.skip(cpu_kernels.unavailable_reason() or "no C++ compiler")
    binary = directory / "stream_sim"
    subprocess.run([compiler, "-O2", "-march=native", "-std=c++17", "-pthread", *switches, str(SOURCE), "-o",
                    str(binary)], check=True, capture_output=True)
    return binary


def assert_reads(result: subprocess.CompletedProcess, layout: str, rounds: int) -> None:
    assert result.returncode == 0, result.stderr
    lines = [LINE.search(line) for line in result.stdout.splitlines()]
    assert lines and all(lines), result.stdout
    assert sum(int(m.group(4)) for m in lines) == rounds  # every round lands in one of the two buckets
    for m in lines:
        assert m.group(1).endswith(layout) and m.group(2) == "1"
        # bandwidths in GB/s; the ratio is the median of each round's own, so it need not equal pass / plain read
        assert all(float(m.group(g)) > 0 for g in (5, 6, 7))


@pytest.fixture(scope="module")
def stream_sim(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("stream_sim"))


@pytest.mark.parametrize("layout", ["guided", "halves", "steal", "per-thread", "zigzag"])
def test_every_layout_reads_the_whole_model(stream_sim, layout):
    result = subprocess.run([str(stream_sim), layout, "1", "2"], capture_output=True, text=True, timeout=120)
    assert_reads(result, layout, 2)


@pytest.mark.parametrize(("layout", "tile_loop"), [("per-thread", "-DLOADS_ONLY=0"), ("zigzag", "-DLOADS_ONLY=1")])
def test_the_build_switches_and_a_layer_count(tmp_path, layout, tile_loop):
    """What docs/benchmarks.md's nineteenth and twentieth sessions built: Intel's prefetches, two blocks side by
    side, the prefetched plain read, the loop without vdpbf16ps, and a layer count other than the 135M model's 30."""
    binary = build(tmp_path, "-DPREFETCH_HINT=_MM_HINT_T0", "-DPREFETCH_BYTES=2048", "-DFAR_PREFETCH_BYTES=8192",
                   "-DSIDE_BY_SIDE_BLOCKS=2", "-DPLAIN_PREFETCH=1", tile_loop)
    assert_reads(subprocess.run([str(binary), layout, "1", "2", "3"], capture_output=True, text=True, timeout=120),
                 layout, 2)


def test_an_unknown_layout_is_refused(stream_sim):
    result = subprocess.run([str(stream_sim), "diagonal", "1", "2"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown layout diagonal" in result.stderr


def test_a_layer_count_below_one_is_refused(stream_sim):
    result = subprocess.run([str(stream_sim), "per-thread", "1", "2", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and "LAYERS must be a positive count, not 0" in result.stderr
