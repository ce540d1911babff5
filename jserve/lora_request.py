"""vLLM's LoRARequest: which LoRA adapter a request runs with. Plain data, so results (jserve.outputs) can name it;
jserve.lora reads the adapter it names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's LoRARequest): a name, an id unique to the adapter, and its PEFT
    directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
