"""Data parallelism: data_parallel_size independent engines, one per row of the [data, model] mesh.

Each replica holds the whole model (split over its own tensor_parallel_size devices), its own KV cache, block
manager and scheduler, so replicas never exchange anything during a step. This front spreads requests over them
(fewest unfinished requests first) and steps them together on worker threads: JAX releases the GIL while a
step runs, so the replicas' device work overlaps. It offers the LLMEngine methods the LLM API and the server use.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from jserve.config import EngineConfig
from jserve.engine.engine import EngineSnapshot, EngineStats, LLMEngine
from jserve.lora import LoraAdapter, LoRARequest
from jserve.outputs import RequestOutput
from sharding import make_mesh, replica_meshes


def create_engine(config: EngineConfig) -> LLMEngine | DataParallelEngine:
    """The engine a config asks for: one LLMEngine, or a data-parallel front over several."""
    return DataParallelEngine(config) if config.data_parallel_size > 1 else LLMEngine(config)


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        if config.num_processes > 1:
            raise ValueError("data_parallel_size > 1 is not supported across processes yet; use one process per "
                             "replica or tensor_parallel_size over all devices")
        self.config = config
        mesh = make_mesh(config.tensor_parallel_size, config.data_parallel_size)
        # Unseeded requests draw their seeds from the engine's generator: give each replica its own stream.
        self.replicas = [LLMEngine(config.replace(seed=config.seed + i, data_parallel_size=1),
                                   devices=list(m.devices.flat))
                         for i, m in enumerate(replica_meshes(mesh))]
        first = self.replicas[0]
        self.tokenizer, self.model_config, self.model_dir = first.tokenizer, first.model_config, first.model_dir
        self.max_model_len, self.sampling_defaults = first.max_model_len, first.sampling_defaults
        self._owner: dict[str, LLMEngine] = {}
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jserve-dp")

    def snapshot(self) -> EngineSnapshot:
        """The replicas' snapshots added up."""
        parts = [vars(e.snapshot()) for e in self.replicas]
        return EngineSnapshot(**{name: _add([p[name] for p in parts]) for name in parts[0]})

    def request_started(self, request_id: str) -> bool:
        engine = self._owner.get(request_id)
        return engine is None or engine.request_started(request_id)

    @property
    def stats(self) -> EngineStats:
        totals = EngineStats()
        for engine in self.replicas:
            for name in vars(totals):
                setattr(totals, name, _add([getattr(totals, name), getattr(engine.stats, name)]))
        return totals

    def add_request(self, request_id: str, prompt, params=None, **kwargs) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine = min(self.replicas, key=lambda e: e.snapshot().num_unfinished_requests)  # first of the least loaded
        engine.add_request(request_id, prompt, params, **kwargs)
        self._owner[request_id] = engine

    def abort_request(self, request_id: str) -> RequestOutput | None:
        engine = self._owner.pop(request_id, None)
        return None if engine is None else engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def add_lora(self, lora_request: LoRARequest, adapter: LoraAdapter | None = None) -> bool:
        """Each replica keeps the adapter in its own slots (read once)."""
        adapter = adapter or self.read_lora(lora_request)
        return all([e.add_lora(lora_request, adapter) for e in self.replicas])

    def read_lora(self, lora_request: LoRARequest) -> LoraAdapter:
        return self.replicas[0].read_lora(lora_request)  # the replicas' models are alike

    def remove_lora(self, lora_int_id: int) -> bool:
        return any([e.remove_lora(lora_int_id) for e in self.replicas])

    def list_loras(self) -> set[int]:
        return self.replicas[0].list_loras()

    def step(self) -> list[RequestOutput]:
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        if len(busy) <= 1:
            outputs = busy[0].step() if busy else []
        else:
            outputs = [out for outs in self._pool.map(LLMEngine.step, busy) for out in outs]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def recover(self, error: BaseException) -> list[str]:
        """LLMEngine.recover on every replica that was stepping (a failed step loses the others' outputs of that
        step too, so their step's requests are dropped as well) -> the dropped request ids."""
        # The other replicas' steps may still be running on the pool: wait for them before touching any replica.
        self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jserve-dp")
        dropped = [rid for e in self.replicas if e.has_unfinished_requests() for rid in e.recover(error)]
        for rid in dropped:
            self._owner.pop(rid, None)
        return dropped

    def warmup(self) -> None:
        list(self._pool.map(LLMEngine.warmup, self.replicas))


def _add(values: list):
    """The sum of the replicas' values; per-position counts (speculative decoding) add position by position."""
    if isinstance(values[0], (list, tuple)):
        longest = max(len(v) for v in values)
        summed = [sum(v[i] for v in values if i < len(v)) for i in range(longest)]
        return type(values[0])(summed)
    return sum(values)
