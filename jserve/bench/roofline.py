"""The memory-bandwidth bound of batch-1 decode: every weight and the whole KV context are read once per token (of
a mixture of experts, the experts the token chose).

bytes per token / stream bandwidth is the least time one decode step can take, so bandwidth / bytes per token is
the most tokens per second any implementation can reach at batch 1.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import cpu_kernels
from jserve.config import ModelConfig
from jserve.models.quantization import quantizes_head

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SCALE_BYTES = 4  # a float32 scale of a quantized weight row or KV row


def experts_reached(cfg: ModelConfig, tokens: int = 1) -> float:
    """Experts of a mixture-of-experts layer that a step of `tokens` tokens reads: each token's k, or, for several
    tokens choosing k of E each as if at random, the expected number of distinct ones, E * (1 - (1 - k/E)^tokens)."""
    k, experts = cfg.num_experts_per_tok, cfg.num_experts
    return k if tokens == 1 else experts * (1 - (1 - k / experts) ** tokens)


def layer_norm_params(cfg: ModelConfig) -> int:
    """A layer's norm weights: two (Gemma 2/3's sandwich: four) of the hidden size, and q/k norms per head or over
    all heads (OLMo)."""
    qk = cfg.q_size + cfg.kv_size if cfg.qk_norm_across_heads else 2 * cfg.head_dim * cfg.qk_norm
    latent = cfg.q_lora_rank + cfg.kv_lora_rank  # DeepSeek's q_a_layernorm and kv_a_layernorm
    return (4 if cfg.sandwich_norms else 2) * cfg.hidden_size + qk + latent


def _latent_attention_reads(cfg: ModelConfig) -> tuple[float, float, int]:
    """(matrix parameters, their rows, other parameters) of DeepSeek's latent attention: q (low-rank or not),
    kv_a_proj_with_mqa, o_proj, and kv_b_proj, which stays in float under weight quantization."""
    hidden, heads, rank, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_rows = heads * (cfg.qk_nope_head_dim + rope)
    shapes = [(q_rows, cfg.q_lora_rank), (cfg.q_lora_rank, hidden)] if cfg.q_lora_rank else [(q_rows, hidden)]
    shapes += [(rank + rope, hidden), (hidden, heads * cfg.v_head_dim)]
    biases = (cfg.q_lora_rank + rank + rope) * cfg.qkv_bias + hidden * cfg.o_bias
    return (sum(r * c for r, c in shapes), sum(r for r, _ in shapes),
            biases + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * rank)


def _layer_reads(cfg: ModelConfig, layer: int, tokens: int = 1) -> tuple[float, float, int]:
    """(parameters of the projection matrices, their rows, other parameters) a decode step of `tokens` tokens reads
    in a layer: a mixture of experts' layer reads the router, the experts its tokens chose and any shared expert."""
    hidden, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    if cfg.kv_lora_rank:
        params, rows, other = _latent_attention_reads(cfg)
        other += layer_norm_params(cfg)
    else:
        params, rows = hidden * (q + 2 * kv) + q * hidden, (q + 2 * kv) + hidden
        other = layer_norm_params(cfg) + (q + 2 * kv) * cfg.qkv_bias + hidden * cfg.o_bias
    if not cfg.layer_moe(layer):
        return params + 3 * hidden * inter, rows + 2 * inter + hidden, other + (2 * inter + hidden) * cfg.mlp_bias
    width, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    reached = experts_reached(cfg, tokens)
    params += 3 * hidden * (reached * width + shared)
    rows += reached * (2 * width + hidden) + (2 * shared + hidden if shared else 0)
    router = hidden * cfg.num_experts + cfg.num_experts * (cfg.moe_routing == "sigmoid_groups")  # and its bias
    gate = hidden if shared and cfg.shared_expert_gated else 0
    return params, rows, other + router + gate


def weight_params_read_per_token(cfg: ModelConfig, tokens: int = 1) -> float:
    """Parameters a decode step reads: every layer, the final norm, the LM head, and one embedding row; with
    `tokens` tokens in the step, the experts they are expected to reach (one token's: an int, its exact count)."""
    layers = sum(params + other for params, _, other in (_layer_reads(cfg, i, tokens) for i in range(cfg.num_layers)))
    return layers + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size + cfg.hidden_size


def weight_bytes_read_per_token(cfg: ModelConfig, dtype: str, quantization: str | None = None,
                                tokens: int = 1) -> float:
    """Bytes of the parameters a decode step reads: in dtype, or with the decoder layers' matrices (and for int8 the
    LM head) in one byte a weight plus a float32 scale a row (int8 / fp8, jserve.models.quantization). `tokens`:
    as weight_params_read_per_token's (the embedding rows of a step's other tokens are not counted)."""
    total = weight_params_read_per_token(cfg, tokens) * DTYPE_BYTES[dtype]
    if quantization is None:
        return total
    for layer in range(cfg.num_layers):
        matrix_params, matrix_rows, _ = _layer_reads(cfg, layer, tokens)
        total -= matrix_params * (DTYPE_BYTES[dtype] - 1) - matrix_rows * SCALE_BYTES
    if quantizes_head(quantization):
        total -= cfg.vocab_size * (cfg.hidden_size * (DTYPE_BYTES[dtype] - 1) - SCALE_BYTES)
    return total


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, context_len: float, kv_cache_dtype: str = "auto") -> float:
    """KV cache read by one decode step attending over context_len tokens (keys and values, all layers); a quantized
    cache holds a byte a value and a float32 scale a (token, KV head) row."""
    row = cfg.head_dim * DTYPE_BYTES[dtype] if kv_cache_dtype == "auto" else cfg.head_dim + SCALE_BYTES
    arrays = 1 if cfg.values_in_key_pages else 2  # latent attention reads its values from the key pages
    return arrays * cfg.num_layers * cfg.num_kv_heads * row * context_len


def decode_bytes_per_token(cfg: ModelConfig, dtype: str, context_len: float, quantization: str | None = None,
                           kv_cache_dtype: str = "auto") -> float:
    return (weight_bytes_read_per_token(cfg, dtype, quantization)
            + kv_bytes_per_token(cfg, dtype, context_len, kv_cache_dtype))


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "48K", "2048K", "266240K"


def last_level_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Size of this CPU's largest data cache level (e.g. "266240K" for L3), from sysfs; None where it says nothing.
    Bytes read per token within a small multiple of it may partly come from that cache instead of the memory."""
    levels = {}
    for index in cpu_dir.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            level = int((index / "level").read_text())
        except (OSError, ValueError):
            continue
        scale = _SIZE_UNITS.get(size[-1:].upper(), 1)
        digits = size[:-1] if size[-1:].upper() in _SIZE_UNITS else size
        if digits.isdigit():
            levels[level] = int(digits) * scale
    return levels[max(levels)] if levels else None


# The roofline's read buffer: the bytes a token reads, within these bounds. How fast a machine reads a buffer depends
# on its size against the caches (this Xeon's 260 MiB L3: 52 GB/s at 128 MiB, ~35 at 256, ~32.5 from 560 MiB up),
# so a fixed size overstated a 588 MB model's bound by ~7% (docs/benchmarks.md). Under the floor a pass is too short
# to time; past the cap (a few times any last-level cache) the rate is the memory's, and the buffer only costs RAM.
STREAM_BUFFER_MIN_BYTES = 64 << 20
STREAM_BUFFER_MAX_BYTES = 1 << 30
_PAGE = 2 << 20  # read_bandwidth's buffer lies on 2 MiB pages


def stream_buffer_bytes(bytes_per_token: float, cache_bytes: int | None = None) -> int:
    """The size of buffer to read for the roofline of a decode that reads `bytes_per_token`: that many bytes, in
    whole 2 MiB pages, at least STREAM_BUFFER_MIN_BYTES and at most the larger of STREAM_BUFFER_MAX_BYTES and four
    times the last-level cache (`cache_bytes`)."""
    cap = max(STREAM_BUFFER_MAX_BYTES, 4 * cache_bytes) if cache_bytes else STREAM_BUFFER_MAX_BYTES
    pages = -(-int(bytes_per_token) // _PAGE)
    return min(max(pages * _PAGE, STREAM_BUFFER_MIN_BYTES), -(-cap // _PAGE) * _PAGE)


def stream_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s the memory is read at, best of `repeats`. With the CPU kernels: every core reading its share of a
    buffer on 2 MiB pages (cpu_kernels.read_bandwidth), as a decode step reads the parameters. Without them: one
    thread's numpy copy counted as STREAM counts it (bytes read + bytes written), a lower bound on the memory."""
    if cpu_kernels.available():
        return cpu_kernels.read_bandwidth(nbytes, repeats=repeats)
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first so the timed copies do not pay for page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best
