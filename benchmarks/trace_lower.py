"""Host seconds to trace and lower the engine's step for a GPU or TPU, measured on any host:

    python benchmarks/trace_lower.py [--model llama3-8b|demo|DIR] [--platform cuda|tpu] [--rounds 3]

Warm-up on a GPU or TPU traces and lowers each step shape in one Python thread, then XLA compiles them on several
(XlaExecutor.compile_ahead); this measures that serial part without the device. The parameters are abstract
(shapes only, so an 8B shape needs no memory), the attention backend is "pallas", and
`jit(...).trace(...).lower(lowering_platforms=(platform,))` runs the lowering the device would (Pallas -> Triton
for cuda, -> Mosaic for tpu). Two variants alternate, every cache cleared before each measurement:
  jitted     attention as the engine runs it: pallas_kernels.interface._attention, traced and lowered once a step
  per-layer  its unjitted function in its place: each layer's call traced and lowered anew
at two step shapes: 8 decode tokens and 512 prefill tokens, both over the full-width page table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ runs from the checkout

from benchmarks.gpu_check.common import model_dir  # noqa: E402
from jserve.config import ModelConfig  # noqa: E402
from jserve.engine.packing import pack  # noqa: E402
from jserve.executors.xla import XlaExecutor  # noqa: E402
from jserve.loading import LoadedModel  # noqa: E402
from jserve.models import model_class  # noqa: E402
from pallas_kernels import interface  # noqa: E402


def abstract_executor(path: Path, dtype: str, max_model_len: int) -> XlaExecutor:
    """An executor over shape-only parameters and a small KV cache: enough to trace and lower its step."""
    config = ModelConfig.from_pretrained(path)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, jnp.dtype(dtype), "pallas"))
    graphdef, state = nnx.split(abstract)
    return XlaExecutor(LoadedModel(config, graphdef, state, "pallas"), dtype=dtype, num_blocks=64, block_size=16,
                       max_num_batched_tokens=512, max_num_seqs=32, max_model_len=max_model_len)


def time_step(executor: XlaExecutor, batch, platform: str) -> tuple[float, float]:
    """(trace s, lower s) of the step for this batch's shapes, every cache cleared first."""
    jax.clear_caches()
    packed, layout = pack(batch)
    step = jax.jit(executor._packed_forward, static_argnums=(3,))
    start = time.perf_counter()
    traced = step.trace(executor.params, executor.kv_cache, packed, layout)
    traced_at = time.perf_counter()
    traced.lower(lowering_platforms=(platform,))
    return traced_at - start, time.perf_counter() - traced_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help='"llama3-8b", "demo" or a checkpoint directory')
    parser.add_argument("--platform", default="cuda", choices=["cuda", "tpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path, _ = model_dir(args.model, Path(tempfile.mkdtemp(prefix="trace_lower_")))
    executor = abstract_executor(path, args.dtype, args.max_model_len)
    widest = max(len(b.page_table[0]) for b in executor.warmup_batches())
    batches = {len(b.token_ids): b for b in executor.warmup_batches() if len(b.page_table[0]) == widest}
    shapes = {"decode 8": batches[min(batches)], "prefill 512": batches[max(batches)]}
    jitted = interface._attention
    variants = {"jitted": jitted, "per-layer": jitted.__wrapped__}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for _ in range(args.rounds):
            for variant, attention in variants.items():
                interface._attention = attention
                for shape, batch in shapes.items():
                    times.setdefault((variant, shape), []).append(time_step(executor, batch, args.platform))
    finally:
        interface._attention = jitted
    cfg = executor.config
    print(f"{args.model} ({cfg.num_layers} layers), {args.platform} lowering, {args.rounds} rounds, median seconds")
    print(f"{'variant':<10} {'shape':<12} {'trace':>7} {'lower':>7} {'total':>7}")
    for (variant, shape), runs in times.items():
        trace, lower = statistics.median(t for t, _ in runs), statistics.median(low for _, low in runs)
        print(f"{variant:<10} {shape:<12} {trace:7.2f} {lower:7.2f} {trace + lower:7.2f}")


if __name__ == "__main__":
    main()
