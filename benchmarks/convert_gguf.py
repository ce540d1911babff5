"""Convert the benchmark model to GGUF with llama.cpp's own convert_hf_to_gguf.py, for llama-server.

    python benchmarks/convert_gguf.py LLAMA_CPP_DIR MODEL_DIR --outtype f32|bf16 --outfile OUT.gguf

LLAMA_CPP_DIR is llama.cpp's source tree (vendor/llama.cpp inside the llama-cpp-python sdist); the remaining
arguments go to convert_hf_to_gguf.py unchanged. The one change: llama.cpp identifies a BPE tokenizer's
pre-tokenizer by hashing how it encodes a test string, and refuses tokenizers it has never seen, such as the
one build_bench_model.py trains. That tokenizer pre-splits text with the GPT-2 regex (tokenizers' ByteLevel with
use_regex), which llama.cpp calls "gpt-2", so the lookup is answered with that and nothing else changes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PRE_TOKENIZER = "gpt-2"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    llama_cpp = Path(argv[0]).resolve()
    script = llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        print(f"{script} not found: pass the llama.cpp source directory", file=sys.stderr)
        return 2
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    from conversion.base import TextModel  # llama.cpp's package, importable once its directory is on the path

    TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    sys.argv = [str(script), *argv[1:]]
    convert.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
