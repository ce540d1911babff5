"""The quickstart notebook runs top to bottom (on the bundled demo model, with test-sized engine settings)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
TEST_SETTINGS = ('LLM(str(__import__("checkpoints").DEMO_MODEL_DIR), warmup=False, compilation_cache_dir="", '
                 'max_model_len=256, kv_cache_memory_bytes=8 << 20)')


def test_quickstart_notebook_runs_on_the_demo_model():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert "llm = LLM()" in code[0]
    code[0] = code[0].replace("LLM()", TEST_SETTINGS)
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        for source in code:
            exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    printed = out.getvalue()
    assert "'def fibonacci(n):' ->" in printed and "length" in printed
    llm = namespace["llm"]
    assert not llm.engine.has_unfinished_requests()
