"""Import layering, read from the source with `ast` (every import counts, at module level or inside a function):

- the libraries (cpu_kernels, sharding, pallas_kernels, checkpoints) never import jserve, and import each other only
  downward in LIBRARY_ORDER;
- inside jserve, a module imports only from its own layer of JSERVE_LAYERS or a lower one, and every module is
  placed in a layer (a new module must be placed here);
- there is no import cycle anywhere among these packages.

Importing a parent package implicitly (`import jserve.engine.engine` runs jserve/__init__.py first) is not an edge:
only the modules an import statement names are.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The libraries, lowest first: each may import the ones before it, never jserve.
LIBRARY_ORDER = ["cpu_kernels", "sharding", "pallas_kernels", "checkpoints"]
PACKAGES = ["jserve", *LIBRARY_ORDER]

# jserve's layers, lowest first. A name stands for that module and everything under it ("jserve.engine" is the whole
# engine package), except a package root, which stands only for its own __init__.py ("jserve": the public API).
JSERVE_LAYERS = [
    # plain data and flags: configs, request parameters (and the LoRA adapter a request names) and results, argparse
    # types, the engine flags, the tokenizer (and its GGUF builder)
    ["jserve.config", "jserve.config_json", "jserve.config_llama4", "jserve.sampling_params", "jserve.pooling_params",
     "jserve.lora_request", "jserve.outputs", "jserve.arg_types", "jserve.engine_args", "jserve.tokenizer",
     "jserve.gguf_tokenizer", "jserve.speculative_config"],
    # the Flax models and their shape under tensor parallelism; what a step carries: a sequence and its scheduled
    # chunk, the packed host arrays, the jitted sampler and its speculative drafts' rejection sampler
    ["jserve.models", "jserve.engine.sequence", "jserve.engine.packing", "jserve.engine.sampler",
     "jserve.engine.rejection"],
    # what builds and runs a model: the checkpoint loader (and its GGUF names and config, its Orbax checkpoints and
    # their writer, LoRA adapters), the executors, the multi-host executor
    ["jserve.loading", "jserve.gguf_loading", "jserve.gguf_deepseek", "jserve.orbax_io", "jserve.convert",
     "jserve.lora", "jserve.executors", "jserve.distributed"],
    # the engine: scheduler, KV blocks, output processing, the step, data parallelism
    ["jserve.engine"],
    # the Python API and batch jobs; `jserve` re-exports the API (LLM lazily)
    ["jserve.llm", "jserve.batch", "jserve"],
    # the OpenAI-compatible server, the benchmarks, the evaluations and the terminal chat (all drive the API or the
    # engine)
    ["jserve.server", "jserve.bench", "jserve.eval", "jserve.chat"],
    # the `jserve` command
    ["jserve.cli", "jserve.__main__"],
]

# Imports (importer, imported module) allowed to break the rules, each with its reason; left out of the cycle search.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages in the checkout: name -> file."""
    return {module_name(path, root): path
            for package in PACKAGES for path in sorted((root / package).rglob("*.py"))
            if "__pycache__" not in path.parts}


def imports_of(path: Path, module: str, modules: Iterable[str]) -> set[str]:
    """The modules of ours one file's import statements name. `from a import b` names a.b where that is a module,
    else a; a name that is no module (yet) counts as the longest prefix of it that is one."""
    known = set(modules)
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from this package, one package up per further dot
                parts = package.split(".")
                source = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                names.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return {resolved for name in names if (resolved := resolve(name, known)) is not None} - {module}


def resolve(name: str, known: set[str]) -> str | None:
    """The module of ours a dotted name lives in (None for the standard library and third parties)."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return parts[0]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports."""
    modules = source_modules(root)
    return {module: imports_of(path, module, modules) for module, path in modules.items()}


def jserve_layer(module: str) -> int | None:
    """The index in JSERVE_LAYERS of the entry that names module most closely; None if no entry does."""
    best, best_len = None, -1
    for level, entries in enumerate(JSERVE_LAYERS):
        for entry in entries:
            covers = module == entry or (entry not in PACKAGES and module.startswith(entry + "."))
            if covers and len(entry) > best_len:
                best, best_len = level, len(entry)
    return best


def describe_layer(level: int) -> str:
    return f"layer {level} [{', '.join(JSERVE_LAYERS[level])}]"


def rule_violations(graph: Mapping[str, set[str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> why that import breaks the layering."""
    found = {}
    for module, targets in graph.items():
        top = module.split(".")[0]
        for target in sorted(targets):
            target_top = target.split(".")[0]
            if top != "jserve":
                if target_top == "jserve":
                    found[module, target] = f"{module} imports {target}: the libraries never import jserve"
                elif LIBRARY_ORDER.index(target_top) > LIBRARY_ORDER.index(top):
                    below = LIBRARY_ORDER[:LIBRARY_ORDER.index(top)]
                    allowed = f"only {', '.join(below)}" if below else "no other library"
                    found[module, target] = (f"{module} imports {target}: {top} may import {allowed} "
                                             f"(LIBRARY_ORDER, lowest first: {', '.join(LIBRARY_ORDER)})")
            elif target_top == "jserve":
                low, high = jserve_layer(module), jserve_layer(target)
                if low is not None and high is not None and high > low:
                    found[module, target] = (f"{module} ({describe_layer(low)}) imports {target} "
                                             f"({describe_layer(high)}): a lower layer imports a higher one")
    return found


def unplaced_modules(modules: Iterable[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] == "jserve" and jserve_layer(m) is None)


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # recursive: the module graph is shallow
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_through(component, graph) for component in sorted(components)]


def _cycle_through(component: list[str], graph: Mapping[str, set[str]]) -> list[str]:
    """The shortest cycle from the component's first module back to itself (breadth-first inside the component)."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph.get(node, ())):
                if succ == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return [*reversed(chain), start]
                if succ in members and succ not in parent:
                    parent[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def check(graph: Mapping[str, set[str]], known: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Every problem with graph, as messages; known edges are skipped (and left out of the cycle search)."""
    problems = [f"{m} is in no layer: place it in JSERVE_LAYERS (tests/test_layering.py)"
                for m in unplaced_modules(graph)]
    problems += [why for edge, why in sorted(rule_violations(graph).items()) if edge not in known]
    remaining = {m: {t for t in targets if (m, t) not in known} for m, targets in graph.items()}
    problems += ["import cycle: " + " -> ".join(cycle) for cycle in find_cycles(remaining)]
    return problems


def test_imports_follow_the_layers():
    graph = import_graph()
    assert "jserve.config" in graph and "sharding.rules" in graph, "found no modules: is ROOT the checkout?"
    problems = check(graph, KNOWN_VIOLATIONS)
    assert not problems, "import layering broken:\n  " + "\n  ".join(problems)
    edges = {(m, t) for m, targets in graph.items() for t in targets}
    stale = sorted(KNOWN_VIOLATIONS - edges)
    if stale:
        warnings.warn(f"KNOWN_VIOLATIONS lists imports that no longer exist; remove them: {stale}", stacklevel=1)


def test_every_layer_entry_names_a_distinct_module():
    entries = [entry for layer in JSERVE_LAYERS for entry in layer]
    assert len(entries) == len(set(entries)), "a module is in two layers"
    assert all(entry.split(".")[0] == "jserve" for entry in entries)


# The checker itself, on made-up graphs.

def test_checker_finds_a_cycle():
    graph = {"sharding.a": {"sharding.b"}, "sharding.b": {"sharding.c"}, "sharding.c": {"sharding.a"},
             "sharding.d": {"sharding.a"}}
    assert find_cycles(graph) == [["sharding.a", "sharding.b", "sharding.c", "sharding.a"]]
    assert check(graph) == ["import cycle: sharding.a -> sharding.b -> sharding.c -> sharding.a"]
    assert check(graph, known={("sharding.c", "sharding.a")}) == []
    assert find_cycles({"sharding.a": {"sharding.b"}, "sharding.b": set()}) == []


def test_checker_finds_layer_breaks():
    graph = {"jserve.config": {"jserve.engine.engine"}, "jserve.engine.engine": {"jserve.config", "sharding.mesh"},
             "sharding.mesh": {"jserve.config"}, "cpu_kernels": {"checkpoints.dummy"}, "checkpoints.dummy": set(),
             "jserve.newthing": set()}
    problems = check(graph)
    assert problems[0] == "jserve.newthing is in no layer: place it in JSERVE_LAYERS (tests/test_layering.py)"
    assert ("cpu_kernels imports checkpoints.dummy: cpu_kernels may import no other library (LIBRARY_ORDER, lowest "
            "first: cpu_kernels, sharding, pallas_kernels, checkpoints)") in problems
    assert any("jserve.config (layer 0" in p and "imports jserve.engine.engine (layer 3" in p for p in problems)
    assert "sharding.mesh imports jserve.config: the libraries never import jserve" in problems
    assert "import cycle: jserve.config -> jserve.engine.engine -> jserve.config" in problems
    assert len(problems) == 5, problems


@pytest.mark.parametrize(("module", "layer"), [("jserve", 4), ("jserve.engine.scheduler", 3), ("jserve.cli", 6),
                                               ("jserve.server.routes", 5), ("jserve.executors.xla", 2),
                                               ("jserve.config", 0), ("jserve.nothing", None)])
def test_modules_take_their_closest_entry(module, layer):
    assert jserve_layer(module) == layer


def test_imports_are_read_at_every_level(tmp_path):
    pkg = tmp_path / "jserve" / "server"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("import os\nfrom jserve import config, __version__\n\ndef f():\n"
                              "    from . import y\n    import sharding.mesh as m\n"
                              "    from jserve.engine.engine import LLMEngine\n    from checkpoints.gone import z\n")
    modules = ["jserve", "jserve.config", "jserve.server", "jserve.server.x", "jserve.server.y",
               "jserve.engine.engine", "sharding", "sharding.mesh", "checkpoints"]
    assert imports_of(pkg / "x.py", "jserve.server.x", modules) == {
        "jserve", "jserve.config", "jserve.server.y", "sharding.mesh", "jserve.engine.engine", "checkpoints"}
