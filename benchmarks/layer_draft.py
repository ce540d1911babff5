"""A draft model for speculative decoding cut from its target: a GGUF file's first N decoder layers, with its
embeddings, final norm, LM head and tokenizer (an early-exit draft, untrained: a baseline for the draft-model
proposer where no smaller model of the same tokenizer is at hand).

    python -m benchmarks.layer_draft TARGET.gguf OUT.gguf --layers 10
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf


def write_layer_draft(source: Path, out: Path, layers: int) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.fields[block_count].contents()
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers must be in [1, {total}] for {source}")
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = layers if field.name == block_count else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors
            if (m := re.match(r"blk\.(\d+)\.", t.name)) is None or int(m.group(1)) < layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, required=True, help="decoder layers kept (the first ones)")
    args = parser.parse_args()
    write_layer_draft(args.source, args.out, args.layers)


if __name__ == "__main__":
    main()
