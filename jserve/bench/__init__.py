"""Benchmarks in the vLLM style: `jserve bench throughput|latency|serve`.

- datasets.py: the requests (random, prefix-repetition, a ShareGPT-like synthetic mix, ShareGPT JSON)
- arrivals.py: when requests are sent (all at once, Poisson, or gamma-distributed gaps)
- metrics.py: TTFT / TPOT / ITL / E2EL statistics, throughputs and goodput from per-request timings
- client.py: one streaming request to an OpenAI-compatible server, timed chunk by chunk
- serve.py: the async load generator; plot.py its PNG
- throughput.py: offline throughput of jserve or transformers `generate` on the same requests
- latency.py and roofline.py: batch-1 prefill/decode speed beside the memory-bandwidth bound
- cli.py: the argparse wiring (imports nothing heavy until a command runs)
"""

# The request sets every command accepts (built by datasets.py); here so the CLI can list them without numpy.
DATASETS = ("random", "prefix-repetition", "mixed", "sharegpt")
