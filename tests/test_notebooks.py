"""Every notebook in notebooks/ runs top to bottom in a real Jupyter kernel (nbclient + ipykernel) on the CPU with the
bundled demo model, and its cells print what they promise.

Test-sized engine settings go in the way a user changes them: a cell added after the one tagged `parameters`
(papermill's convention), or for the quickstart the `LLM()` call's arguments.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from checkpoints import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TEST_ENGINE_ARGS = dict(model=str(DEMO_MODEL_DIR), warmup=False, compilation_cache_dir="", max_model_len=256,
                        kv_cache_memory_bytes=8 << 20, max_num_seqs=8)
QUICKSTART_LLM = f"LLM({str(DEMO_MODEL_DIR)!r}, warmup=False, compilation_cache_dir='', max_model_len=256, " \
                 "kv_cache_memory_bytes=8 << 20)"


def test_every_notebook_is_tested():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} == {"quickstart.ipynb", "serve_openai.ipynb",
                                                           "benchmark.ipynb"}


@pytest.fixture(autouse=True)
def checkout_on_path(monkeypatch):
    # The kernel runs in a temporary directory: it (and the processes it starts) import this checkout.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def run_notebook(name: str, tmp_path: Path) -> tuple[list[str], nbformat.NotebookNode]:
    """Execute the notebook (in tmp_path); return each code cell's printed text, in order, and the notebook."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    install = nb.cells[1]
    assert install.cell_type == "code" and 'find_spec("jserve") is None' in install.source, \
        "the first code cell installs jserve only where it is missing (Colab)"
    params = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    if params:
        nb.cells.insert(params[0] + 1, nbformat.v4.new_code_cell(f"ENGINE_ARGS.update({TEST_ENGINE_ARGS!r})"))
    else:
        (cell,) = [c for c in nb.cells if "llm = LLM()" in c.source]
        cell.source = cell.source.replace("LLM()", QUICKSTART_LLM)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            texts.append("".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"))
    return texts, nb


def test_quickstart(tmp_path):
    texts, _ = run_notebook("quickstart.ipynb", tmp_path)
    printed = "".join(texts)
    assert "'def fibonacci(n):' ->" in printed and "length" in printed
    assert len(texts[3].splitlines()) == 4  # one line (a repr) per sampled request
    assert texts[4].strip()  # the chat reply


def test_serve_openai(tmp_path):
    texts, _ = run_notebook("serve_openai.ipynb", tmp_path)
    printed = "\n".join(texts)
    assert "jax runs on: cpu" in printed
    assert re.search(r"serving on http://127\.0\.0\.1:\d+: \{'status': 'ok'\}", printed)
    assert "models: ['demo']" in printed
    chunks = int(re.search(r"--- (\d+) chunks", printed).group(1))
    assert chunks > 1  # streamed in pieces
    assert "same text streamed and not: True" in printed
    usage = json.loads(re.search(r"usage: (\{.*\})", printed).group(1).replace("'", '"'))
    assert usage["completion_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + \
        usage["completion_tokens"]
    assert "server stopped: True" in printed


def test_benchmark(tmp_path):
    texts, nb = run_notebook("benchmark.ipynb", tmp_path)
    printed = "\n".join(texts)
    summary = json.loads(re.search(r"summary: (\{.*\})", printed).group(1).replace("'", '"'))
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 16 * 32  # --ignore-eos: every requested token
    assert summary["output_throughput"] > 0 and summary["mean_ttft_ms"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 1  # the plot, shown inline
    assert "server stopped: True" in printed
