"""Measure host memory while a checkpoint loads onto a mesh (the figures in docs/deploy-tpu-vm.md).

    python -m tools.load_memory --synthetic /tmp/ckpt    # writes a 0.5B-parameter bf16 Llama checkpoint once
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tools.load_memory /tmp/ckpt --tp 8

A thread samples the process's anonymous resident memory (RssAnon: heap and arrays, not the page cache behind
the memory-mapped safetensors files) every millisecond. On CPU the "devices" live in host memory too, so the
figure reported is the peak of RssAnon minus the baseline minus the bytes of the parameters placed so far: the
host buffers in flight while parameters are built (on TPU/GPU the placed bytes leave the host entirely).
"""

from __future__ import annotations

import argparse
import json
import struct
import threading
import time
from pathlib import Path

import numpy as np


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def write_synthetic(out: Path, hidden: int = 2048, layers: int = 8, heads: int = 16, kv_heads: int = 8,
                    intermediate: int = 5632, vocab: int = 32000) -> None:
    """A random-weight bfloat16 Llama checkpoint, streamed tensor by tensor (never whole in memory)."""
    import ml_dtypes

    out.mkdir(parents=True, exist_ok=True)
    d = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   a + "q_proj.weight": (heads * d, hidden), a + "k_proj.weight": (kv_heads * d, hidden),
                   a + "v_proj.weight": (kv_heads * d, hidden), a + "o_proj.weight": (hidden, heads * d),
                   m + "gate_proj.weight": (intermediate, hidden), m + "up_proj.weight": (intermediate, hidden),
                   m + "down_proj.weight": (hidden, intermediate)}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    rng = np.random.default_rng(0)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            scale = 1.0 if name.endswith("norm.weight") else 0.02
            f.write((rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16).tobytes())
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))


def measure(model_dir: str, tp: int, dtype: str) -> dict:
    import jax

    from checkpoints.safetensors_loader import checkpoint_files, iter_tensors, load_state
    from jserve import loading
    from sharding import make_mesh

    largest = max(t.nbytes for f in checkpoint_files(model_dir) for _, t in iter_tensors(f))
    mesh = make_mesh(tp) if tp > 1 else None
    jax.devices()  # start the runtime before the baseline
    placed, extra, done = [0], [0], threading.Event()

    def counting_place_sharded(source, sharding):  # loading.place_sharded, counting each shard once it is placed
        shards = []
        for device, index in sharding.addressable_devices_indices_map(source.shape).items():
            shards.append(jax.block_until_ready(jax.device_put(source.read(index), device)))
            placed[0] += shards[-1].nbytes
        return jax.make_array_from_single_device_arrays(source.shape, sharding, shards)

    def counting_load_state(model_dir, config, shapes, place):
        def counted(path, source):
            if mesh is not None:
                return place(path, source)  # counted shard by shard in counting_place_sharded
            array = jax.block_until_ready(place(path, source))
            placed[0] += array.nbytes
            return array
        return load_state(model_dir, config, shapes, counted)

    def sample() -> None:  # host memory beyond the parameters already placed (which, on CPU, are host memory)
        while not done.is_set():
            extra[0] = max(extra[0], rss_anon() - baseline - placed[0])
            time.sleep(0.001)

    loading.load_state, loading.place_sharded = counting_load_state, counting_place_sharded
    baseline = rss_anon()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = loading.load_model(model_dir, dtype, "reference", mesh=mesh)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    final = rss_anon()
    arrays = jax.tree.leaves(model.state)
    per_device: dict[int, int] = {}
    for a in arrays:
        for shard in a.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    mib = 1 << 20
    return {"tp": tp, "dtype": dtype, "load_s": round(seconds, 2),
            "params_MiB": round(sum(a.nbytes for a in arrays) / mib, 1),
            "largest_tensor_MiB": round(largest / mib, 1),
            "max_per_device_MiB": round(max(per_device.values()) / mib, 1),
            "rss_growth_MiB": round((final - baseline) / mib, 1),
            "peak_in_flight_MiB": round(extra[0] / mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--synthetic", action="store_true", help="write a synthetic checkpoint to model_dir first")
    args = parser.parse_args()
    if args.synthetic:
        write_synthetic(Path(args.model_dir))
        return
    print(json.dumps(measure(args.model_dir, args.tp, args.dtype)))


if __name__ == "__main__":
    main()
