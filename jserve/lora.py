"""LoRA adapters: a PEFT adapter directory read into the fused layout of the model's projections.

A request names an adapter with a LoRARequest (vLLM's fields). Its `adapter_model.safetensors` holds, for each
adapted projection of the base model, A [r, in] and B [out, r]; the projection's output gains
scaling * (x A^T) B^T, scaling = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA).

The model fuses q|k|v and gate|up into one matmul each, reorders q/k rows for partial rotary embedding and folds
Granite's residual multiplier and longrope's attention factor into rows. B's rows are rows of the projection's
output, so they go through the same layout (checkpoints.tensor_views.llama_layout, then the fused row map) as the
weights do. A fused projection's adapter is one of rank parts x max_lora_rank: each part's A fills its own block of
rows, and its B its own block of columns, so the parts do not mix.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoints import CheckpointError
from checkpoints.safetensors_loader import FUSED_PARTS, fused_row_map, iter_tensors
from checkpoints.tensor_views import llama_layout, take
from jserve.config import ModelConfig
from jserve.lora_request import LoRARequest  # noqa: F401 - re-exported: jserve.lora.LoRARequest

# Where each checkpoint projection goes: (the decoder block, the model's projection holding it)
_TARGETS = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
            "v_proj": ("self_attn", "qkv_proj"), "qkv_proj": ("self_attn", "qkv_proj"),
            "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_up_proj"),
            "up_proj": ("mlp", "gate_up_proj"), "gate_up_proj": ("mlp", "gate_up_proj"),
            "down_proj": ("mlp", "down_proj")}
LORA_MODULES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}  # the model's modules: parts each
_NAME = re.compile(r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.)?"
                   r"(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot serve on this model, with the reason."""


@dataclass
class LoraAdapter:
    """An adapter in the model's layout: for each adapted module (a path of the model, e.g. ("layers", 0,
    "self_attn", "qkv_proj")), A f32[parts * max_lora_rank, in] and B f32[out, parts * max_lora_rank], the scaling
    folded into B."""

    request: LoRARequest
    rank: int
    modules: dict[tuple, tuple[np.ndarray, np.ndarray]]
    # Set by the engine when it reads the adapter, unique among its reads: the prefix cache's salt, so K/V computed
    # with an adapter that was removed are never reused by another read under the same id.
    serial: int = 0


def lora_width(module: str, max_lora_rank: int) -> int:
    """The rank dimension of a module's adapter stacks."""
    return LORA_MODULES[module] * max_lora_rank


def load_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int) -> LoraAdapter:
    """Read request.lora_path (a PEFT LoRA directory) for a model of this config (the sharded config under tensor
    parallelism: its fused layout). Raises LoRAError naming the file and what does not fit."""
    path = Path(request.lora_path).expanduser()
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAError(f"{path}: not a LoRA adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{cfg_file}: cannot read it ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_file}: expected a JSON object")
    _check_config(cfg, cfg_file, config)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{cfg_file}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"{cfg_file}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_lora_rank:
        raise LoRAError(f"{path}: the adapter's rank {rank} exceeds max_lora_rank {max_lora_rank}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        other = " (adapter_model.bin is a pickle: save it with safe_serialization)" \
            if (path / "adapter_model.bin").is_file() else ""
        raise LoRAError(f"{path}: no adapter_model.safetensors{other}")
    try:
        tensors = dict(iter_tensors(weights))
    except CheckpointError as e:
        raise LoRAError(str(e)) from None
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        m = _NAME.match(name)
        if m is None or m[4] not in _TARGETS or _TARGETS[m[4]][0] != m[3]:
            raise LoRAError(f"{weights}: tensor {name} adapts a module jserve does not serve LoRA on (the decoder "
                            f"layers' q/k/v/o and gate/up/down projections)")
        if int(m[2]) >= config.num_layers:
            raise LoRAError(f"{weights}: tensor {name} is for layer {m[2]}; the model has {config.num_layers}")
        pairs.setdefault(m[1], {})[m[5]] = np.asarray(tensor, np.float32)
    if not pairs:
        raise LoRAError(f"{weights}: holds no LoRA tensors")
    modules: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{weights}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"{weights}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of "
                            f"rank {rank}")
        _place(modules, module, a, b * np.float32(scaling), config, max_lora_rank, str(weights))
    return LoraAdapter(request, rank, modules)


def _check_config(cfg: dict, cfg_file: Path, config: ModelConfig) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{cfg_file}: peft_type {cfg['peft_type']!r} is not a LoRA adapter")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (trained copies of whole modules)",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
               "fan_in_fan_out": "fan_in_fan_out"}
    for key, what in refused.items():
        if cfg.get(key):
            raise LoRAError(f"{cfg_file}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_file}: bias {cfg['bias']!r} is not supported (only 'none')")
    if config.num_experts:
        raise LoRAError(f"{cfg_file}: LoRA on a mixture of experts ({config.model_type}) is not supported")


def _place(modules: dict, module: str, a: np.ndarray, b: np.ndarray, config: ModelConfig, max_rank: int,
           origin: str) -> None:
    """Put one checkpoint module's A and scaled B into the model module's stacks (made on first use)."""
    layer = int(module.split(".")[2])
    proj = module.rsplit(".", 1)[1]
    block, dest = _TARGETS[proj]
    in_features = {"qkv_proj": config.hidden_size, "o_proj": config.q_size, "gate_up_proj": config.hidden_size,
                   "down_proj": config.intermediate_size}[dest]
    if a.shape[1] != in_features:
        raise LoRAError(f"{origin}: {module}'s lora_A has {a.shape[1]} columns; the model's {proj} takes "
                        f"{in_features} inputs")
    out_features = {"qkv_proj": config.q_size + 2 * config.kv_size, "o_proj": config.hidden_size,
                    "gate_up_proj": 2 * config.intermediate_size, "down_proj": config.hidden_size}[dest]
    key = ("layers", layer, block, dest)
    width = lora_width(dest, max_rank)
    if key not in modules:
        modules[key] = (np.zeros((width, in_features), np.float32), np.zeros((out_features, width), np.float32))
    a_full, b_full = modules[key]
    # B's rows in the model's layout: each part (q, k, v / gate, up) as the weight's rows are laid out
    try:
        parts = [(name.rsplit(".", 2)[-2], view) for name, view, _ in
                 llama_layout([(f"{module}.weight", b, origin)], config)]
    except CheckpointError as e:
        raise LoRAError(str(e)) from None
    names = FUSED_PARTS.get(dest, (dest,))
    for part, view in parts:
        rows = take(view, (), np.float32)
        index = names.index(part) if part in names else 0
        cols = slice(index * max_rank, index * max_rank + a.shape[0])
        a_full[cols] = a
        if dest in FUSED_PARTS:
            dest_rows, src_rows = fused_row_map(config, dest, out_features)[part]
            if rows.shape[0] != int(src_rows.max()) + 1:
                raise LoRAError(f"{origin}: {module}'s lora_B has {rows.shape[0]} rows; the model's {part} has "
                                f"{int(src_rows.max()) + 1}")
            b_full[dest_rows, cols] = rows[src_rows]
        else:
            if rows.shape[0] != out_features:
                raise LoRAError(f"{origin}: {module}'s lora_B has {rows.shape[0]} rows; the model's {proj} has "
                                f"{out_features}")
            b_full[:, cols] = rows
