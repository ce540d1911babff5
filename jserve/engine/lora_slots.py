"""Which LoRA adapter each of the executor's max_loras slots holds.

A sequence with an adapter takes a slot when it is first admitted and keeps it until it finishes (through
preemption too), so the adapters of a step's sequences are always resident. An adapter already in a slot is
shared; otherwise the least recently used slot that no sequence holds is written with it. When every slot is held
by sequences of other adapters, the sequence waits (the scheduler admits no one past it) until one finishes.

Adapters are read once per id (`register`) and kept in host memory until removed (`remove`, vLLM's remove_lora):
requests already queued or running with a removed adapter finish with it, and a later read under the same id is
another adapter (slots match adapters by identity, and each read salts the prefix cache with its own serial).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from jserve.config import ModelConfig
from jserve.engine.sequence import Sequence
from jserve.lora import LoraAdapter, LoRAError, LoRARequest, load_adapter

# Serials of the adapters read in this process (data-parallel replicas share an adapter read once).
_SERIALS = itertools.count(1)


class LoraSlots:
    def __init__(self, max_loras: int, max_lora_rank: int, model_config: ModelConfig,
                 write: Callable[[int, LoraAdapter | None], None]):
        """write(slot, adapter): the executor's set_lora."""
        self.max_lora_rank, self.model_config, self.write = max_lora_rank, model_config, write
        self.adapters: dict[int, LoraAdapter] = {}  # the adapters read and not removed, by lora_int_id (host copies)
        self.holder: list[LoraAdapter | None] = [None] * max_loras  # the adapter written into each slot
        self.users = [0] * max_loras  # unfinished sequences holding each slot
        self.last_used = [0] * max_loras
        self._clock = 0
        self.loads = 0  # adapters written into slots

    def register(self, request: LoRARequest) -> LoraAdapter:
        """The adapter of a request, read (and checked against the model) the first time its id is seen."""
        return self.known(request) or self.install(self.read(request))

    def known(self, request: LoRARequest) -> LoraAdapter | None:
        """The adapter already read for this request's id; LoRAError where the id names another adapter."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None and (known.request.lora_name, known.request.lora_path) != \
                (request.lora_name, request.lora_path):
            raise LoRAError(f"lora_int_id {request.lora_int_id} already names adapter "
                            f"{known.request.lora_name!r} ({known.request.lora_path})")
        return known

    def read(self, request: LoRARequest) -> LoraAdapter:
        """The request's adapter read from disk for this model (touches no slot: any thread may call it)."""
        return load_adapter(request, self.model_config, self.max_lora_rank)

    def install(self, adapter: LoraAdapter) -> LoraAdapter:
        """Keep an adapter read by `read` under its id (the one already kept where the id has been read)."""
        known = self.known(adapter.request)
        if known is not None:
            return known
        if not adapter.serial:
            adapter.serial = next(_SERIALS)
        self.adapters[adapter.request.lora_int_id] = adapter
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter with this id (False: none has it). Sequences that already have it keep it; its slot is
        freed once none holds it."""
        adapter = self.adapters.pop(lora_int_id, None)
        if adapter is None:
            return False
        for slot, held in enumerate(self.holder):
            if held is adapter and self.users[slot] == 0:
                self.holder[slot] = None  # the host copy goes with the last reference
        return True

    def acquire(self, seq: Sequence) -> bool:
        """Give the sequence its adapter's slot (writing the adapter into a free one if needed); False: none free."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        slot = next((s for s, held in enumerate(self.holder) if held is seq.lora), None)
        if slot is None:
            free = [s for s, n in enumerate(self.users) if n == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.holder[s] is not None, self.last_used[s]))
            self.write(slot, seq.lora)
            self.holder[slot] = seq.lora
            self.loads += 1
        self.users[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        slot = seq.lora_slot
        if slot >= 0:
            self.users[slot] -= 1
            seq.lora_slot = -1
            held = self.holder[slot]
            if self.users[slot] == 0 and held is not None and \
                    self.adapters.get(held.request.lora_int_id) is not held:  # removed while in use
                self.holder[slot] = None
