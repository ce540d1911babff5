"""Which LoRA adapter each of the executor's max_loras slots holds.

A sequence with an adapter takes a slot when it is first admitted and keeps it until it finishes (through
preemption too), so the adapters of a step's sequences are always resident. An adapter already in a slot is
shared; otherwise the least recently used slot that no sequence holds is written with it. When every slot is held
by sequences of other adapters, the sequence waits (the scheduler admits no one past it) until one finishes.
"""

from __future__ import annotations

from collections.abc import Callable

from jserve.config import ModelConfig
from jserve.engine.sequence import Sequence
from jserve.lora import LoraAdapter, LoRAError, LoRARequest, load_adapter


class LoraSlots:
    def __init__(self, max_loras: int, max_lora_rank: int, model_config: ModelConfig,
                 write: Callable[[int, LoraAdapter | None], None]):
        """write(slot, adapter): the executor's set_lora."""
        self.max_lora_rank, self.model_config, self.write = max_lora_rank, model_config, write
        self.adapters: dict[int, LoraAdapter] = {}  # every adapter read so far, by lora_int_id (host copies)
        self.holder: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        self.users = [0] * max_loras  # unfinished sequences holding each slot
        self.last_used = [0] * max_loras
        self._clock = 0
        self.loads = 0  # adapters written into slots

    def register(self, request: LoRARequest) -> LoraAdapter:
        """The adapter of a request, read (and checked against the model) the first time its id is seen."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, known.request.lora_path) != (request.lora_name, request.lora_path):
                raise LoRAError(f"lora_int_id {request.lora_int_id} already names adapter "
                                f"{known.request.lora_name!r} ({known.request.lora_path})")
            return known
        adapter = load_adapter(request, self.model_config, self.max_lora_rank)
        self.adapters[request.lora_int_id] = adapter
        return adapter

    def acquire(self, seq: Sequence) -> bool:
        """Give the sequence its adapter's slot (writing the adapter into a free one if needed); False: none free."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        lora_id = seq.lora.request.lora_int_id
        if lora_id in self.holder:
            slot = self.holder.index(lora_id)
        else:
            free = [s for s, n in enumerate(self.users) if n == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.holder[s] is not None, self.last_used[s]))
            self.write(slot, seq.lora)
            self.holder[slot] = lora_id
            self.loads += 1
        self.users[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.users[seq.lora_slot] -= 1
            seq.lora_slot = -1
