"""What a profiled kernel computes: the jax ops and source lines behind an XLA fusion's name.

A GPU trace names a kernel after the HLO instruction it runs ("loop_convert_fusion_32" runs
%loop_convert_fusion.32; cuBLAS and Triton kernels have their own names), which says nothing of which model op it
is. The profile section has XLA dump each module's optimized HLO as text (XLA_FLAGS --xla_dump_to); each
instruction there carries the metadata jax gave the op it came from (op_name, source_file, source_line), and a
fusion's fused computation holds those of every op fused into it. sources() maps the heaviest events' names to them.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
# The dump's tables of source locations, which metadata's stack_frame_id points into (newer XLA).
_TABLE_ROW = {"FileNames": re.compile(r'^(\d+) "(.*)"$'),
              "FileLocations": re.compile(r"^(\d+) \{file_name_id=(\d+) .*?\bline=(\d+)"),
              "StackFrames": re.compile(r"^(\d+) \{file_location_id=(\d+)")}


def dump_flags(dump_dir: str | Path) -> list[str]:
    """XLA_FLAGS that write each module's HLO after optimizations, as text, into dump_dir."""
    return [f"--xla_dump_to={dump_dir}", "--xla_dump_hlo_as_text", "--xla_dump_hlo_pass_re=^$"]


def _frames(text: str) -> dict[str, str]:
    """stack_frame_id -> "file:line", from the dump's FileNames, FileLocations and StackFrames tables."""
    rows: dict[str, dict[str, tuple]] = {name: {} for name in _TABLE_ROW}
    table = None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")):  # the computations follow the tables
            break
        if line.isalpha():  # a table's header
            table = line if line in _TABLE_ROW else None
        elif table and (match := _TABLE_ROW[table].match(line)):
            rows[table][match.group(1)] = match.groups()[1:]
    files = {k: Path(v[0]).name for k, v in rows["FileNames"].items()}
    locations = {k: f"{files.get(v[0], '?')}:{v[1]}" for k, v in rows["FileLocations"].items()}
    return {k: locations.get(v[0], "?") for k, v in rows["StackFrames"].items()}


def _describe(line: str, frames: dict[str, str]) -> str | None:
    """An instruction's op, as jax named it (its last two path parts), and its source file and line."""
    op = _OP_NAME.search(line)
    if op is None:
        return None
    name = "/".join(op.group(1).split("/")[-2:])
    if source := _SOURCE.search(line):
        return f"{name} @ {Path(source.group(1)).name}:{source.group(2)}"
    frame = _FRAME.search(line)
    return f"{name} @ {frames[frame.group(1)]}" if frame and frame.group(1) in frames else name


def parse(text: str) -> dict[str, Counter]:
    """Instruction name -> Counter of the descriptions of the ops it runs: those of the computations it calls
    (calls= / to_apply=: a fusion's fused ops), else its own."""
    own: dict[str, Counter] = {}  # a computation's instructions' descriptions
    instructions: dict[str, tuple[str, list[str]]] = {}  # name -> (its line, the computations it calls)
    computation, frames = None, _frames(text)
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line:
            computation = header.group(1)
            own.setdefault(computation, Counter())
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        instructions[match.group(1)] = (line, _CALLS.findall(line))
        described = _describe(line, frames)
        if computation is not None and described:
            own[computation][described] += 1
    result = {}
    for name, (line, calls) in instructions.items():
        ops = sum((own.get(c, Counter()) for c in calls), Counter())
        if not ops and (described := _describe(line, frames)):
            ops = Counter({described: 1})
        if ops:
            result[name] = ops
    return result


def _instruction_names(event_name: str) -> list[str]:
    """The HLO instruction names an event's name may stand for: itself, and a kernel's "name_N" as "name.N"."""
    names = [event_name]
    match = re.fullmatch(r"(.+)_(\d+)", event_name)
    if match:
        names.append(f"{match.group(1)}.{match.group(2)}")
    return names


def sources(dump_dir: str | Path, event_names: list[str], limit: int = 4) -> dict[str, list[str]]:
    """Each event name found in the dump's optimized modules -> its most frequent op descriptions (at most limit).
    A name in several modules merges theirs."""
    found: dict[str, Counter] = {}
    for path in sorted(Path(dump_dir).glob("*after_optimizations.txt")):
        table = parse(path.read_text(errors="replace"))
        for event in event_names:
            for name in _instruction_names(event):
                if name in table:
                    found[event] = found.get(event, Counter()) + table[name]
                    break
    return {event: [d for d, _ in ops.most_common(limit)] for event, ops in found.items()}
