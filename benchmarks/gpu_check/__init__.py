"""The accelerator check: jserve's JAX path (Flax model, Triton attention kernel, jitted sampler) on a GPU, against
references on the same machine.

    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR                          # on a GPU, about 8 minutes
    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR --device cpu --model demo   # the same sections, tiny

Each section runs in its own process (a crash or hang loses that section alone; the GPU's memory is free for the
next), under its own time limit, and writes its results as it goes: env (versions, measured HBM bandwidth and
matmul rate), kernels (the Triton kernel against the reference; its time against XLA's gather), parity (greedy
tokens against transformers on the same device, Pallas against the reference backend), speed (a Llama-3-8B-shaped
model with dummy weights: batch-1 decode against the roofline, throughput, TTFT, warm-up) and hf (transformers'
`generate` on the same shape). DIR/gpu_check.json holds everything, DIR/gpu_check.md the tables.
"""
