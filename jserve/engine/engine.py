"""EngineCore: schedule -> run -> sample -> emit, one step at a time.

The engine validates requests, turns them into sequences, and after each step appends the sampled tokens,
detokenizes them incrementally, applies the stop conditions and reports every request that changed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import DEMO_MODEL_DIR
from checkpoints.loading import load_model, resolve_model_path
from jserve.config import EngineConfig, ModelLoadError
from jserve.engine.kv_cache import BlockManager
from jserve.engine.packing import pack
from jserve.engine.runner import STOP_IDS_WIDTH, ModelRunner, kv_bytes_per_block, no_stop_ids, pick_bucket
from jserve.engine.sampler import (
    MetadataCache,
    for_burst,
    has_penalty,
    sample_packed,
    token_logprobs,
    warmup_metadata,
)
from jserve.engine.scheduler import Scheduler, SchedulerOutput
from jserve.engine.sequence import Sequence, SequenceStatus
from jserve.outputs import CompletionOutput, RequestOutput
from jserve.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams
from jserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, load_tokenizer
from pallas_kernels import resolve_backend
from sharding import distributed, make_mesh

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class SeqStream:
    """The text side of one sequence: incremental detokenization and stop-string matching."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    streams: list[SeqStream]
    arrival_time: float
    final_only: bool = False  # reported once, when it finishes (RequestOutputKind.FINAL_ONLY)
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all([s.seq.status is SequenceStatus.FINISHED for s in self.streams])  # read per request per step

    def output(self) -> RequestOutput:
        outputs = [CompletionOutput(index=s.seq.index, text=s.text, token_ids=list(s.seq.output_token_ids),
                                    finish_reason=s.seq.finish_reason, stop_reason=s.seq.stop_reason,
                                    logprobs=None if s.logprobs is None else list(s.logprobs))
                   for s in self.streams]
        prompt_logprobs = self.streams[0].prompt_logprobs
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs, finished=self.finished,
                             num_cached_tokens=self.streams[0].seq.num_cached_tokens, metrics=dict(self.metrics),
                             prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs))


@dataclass
class EngineStats:
    num_computed_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0  # model steps (a decode burst counts each of its steps)
    num_engine_steps: int = 0  # calls of LLMEngine.step that ran something
    step_seconds: float = 0.0  # their wall time
    device_wait_seconds: float = 0.0  # of which blocked on the device's results; the rest is the host's work
    warmup_seconds: float = 0.0  # LLMEngine.warmup: compiling every step shape up front
    warmup_step_shapes: int = 0
    warmup_burst_shapes: int = 0


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
        self.config = config
        distributed.initialize(config)  # multi-host: join the other processes before touching a device
        _enable_compilation_cache(config.compilation_cache_dir)
        model_dir = resolve_model_path(config.model) if config.model else DEMO_MODEL_DIR
        self.model_dir = model_dir
        self.tokenizer: Tokenizer = load_tokenizer(str(config.tokenizer or model_dir))
        self.mesh = None if devices is None and config.tensor_parallel_size == 1 and config.num_processes == 1 \
            else make_mesh(config.tensor_parallel_size, 1, devices)
        if config.num_processes > 1 and self.mesh.size != jax.device_count():
            raise ValueError(f"multi-host: tensor_parallel_size must cover every process's devices "
                             f"({jax.device_count()} in all), got {config.tensor_parallel_size}")
        model = load_model(model_dir, config.dtype, resolve_backend(config.attention_backend), mesh=self.mesh,
                           load_format=config.load_format)
        self.model_config = model.config
        self.max_model_len = self._max_model_len()
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        runner_class = ModelRunner if config.num_processes == 1 else distributed.MultiHostRunner
        self.runner = runner_class(model, dtype=config.dtype, num_blocks=num_blocks, block_size=config.block_size,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  mesh=self.mesh)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        # Decode-only steps run forward and sample in one device call (a burst of 1 or more steps) where the runner
        # can: one dispatch instead of two, and the logits never leave the device.
        self._bursts_possible = self.runner.supports_burst
        self._decode_step_seconds: dict[int, float] = {}  # the last decode step's time, by batch bucket (bursts)
        self._metadata = MetadataCache()
        if config.warmup:
            self.warmup()

    # ----- set-up -----

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        # The budget is per device: tensor parallelism splits each block's KV heads over the model axis.
        per_block = kv_bytes_per_block(self.model_config, cfg.block_size, cfg.dtype) // cfg.tensor_parallel_size
        budget = cfg.kv_cache_memory_bytes or _device_kv_budget(cfg.kv_cache_fraction) or DEFAULT_KV_CACHE_BYTES
        num_blocks = distributed.agree_on_min(budget // per_block)  # multi-host: one cache shape on every host
        blocks_per_request = math.ceil(self.max_model_len / cfg.block_size)
        if num_blocks < blocks_per_request:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {cfg.block_size} tokens, but one "
                f"request of max_model_len={self.max_model_len} tokens needs {blocks_per_request}; raise "
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
        batches = list(self.runner.warmup_batches())
        bursts = [(b, for_burst(warmup_metadata(len(b.seq_lens))[0]), self.config.decode_burst)
                  for b in self.runner.burst_batches()]
        placement = self.runner.devices_of_logits()
        if self.runner.mesh is None:
            # The sampler's variants compile on a thread of their own while the steps compile (XLA releases the
            # GIL): its logits are (rows, vocab) for each token bucket's rows.
            vocab = self.model_config.vocab_size
            rows = sorted({len(b.seq_lens) for b in batches})
            with ThreadPoolExecutor(1, thread_name_prefix="jserve-sampler") as pool:
                sampler = pool.submit(lambda: [self._warm_sampler((n, vocab), placement) for n in rows])
                logits_shapes = set(self.runner.compile_ahead(batches, bursts))
                sampler.result()
            assert logits_shapes == {(n, vocab) for n in rows}, logits_shapes
        else:  # a sharded (or multi-process) step compiles on its first run, in lockstep on every process
            logits_shapes = {tuple(self.runner.run(batch).shape) for batch in batches}
            for shape in sorted(logits_shapes):
                self._warm_sampler(shape, placement)
        stats = self.stats
        stats.warmup_seconds = time.perf_counter() - start
        stats.warmup_step_shapes, stats.warmup_burst_shapes = len(batches), len(bursts)
        logger.info("warm-up compiled %d step shapes and %d decode bursts in %.1f s", len(batches), len(bursts),
                    stats.warmup_seconds)

    @staticmethod
    def _warm_sampler(shape: tuple[int, int], placement: jax.sharding.Sharding) -> None:
        # Committed to the step's device(s) as a step's logits are: jit keys its cache on committedness, so
        # uncommitted warm-up logits would leave the first real step of each shape to compile the sampler again.
        logits = jax.device_put(jnp.zeros(shape, jnp.float32), placement)
        for meta in warmup_metadata(shape[0]):
            jax.block_until_ready(sample_packed(logits, *pack(meta)))

    # ----- requests -----

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize_prompt(prompt)
        params = self._resolve_params(params, len(prompt_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        streams = []
        for index in range(params.n):
            seq = Sequence(request_id, prompt_ids, params, index=index, priority=priority, arrival_time=arrival)
            seq.sampling_seed = self._sampling_seed(params.seed, index)
            # Text nobody reads until the end is decoded once, at the end, unless stop strings must watch it.
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                           streaming=not final_only or bool(params.stop))
            streams.append(SeqStream(seq, detok, StopStringMatcher(params.stop, params.include_stop_str_in_output),
                                     logprobs=[] if params.logprobs is not None else None))
        for stream in streams:  # raises before anything is registered if the request could never run
            self.scheduler.check_fits(stream.seq)
        self.requests[request_id] = RequestState(request_id, prompt_text, prompt_ids, streams, arrival, final_only)
        for stream in streams:
            self.scheduler.add(stream.seq)

    def _tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidParameterError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = max(self.model_config.vocab_size, self.tokenizer.vocab_size)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise InvalidParameterError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise InvalidParameterError("prompt", f"prompt must be a string or a list of token ids, got "
                                                  f"{type(prompt).__name__}")
        if not ids:
            raise InvalidParameterError("prompt", "the prompt is empty: it must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise InvalidParameterError(
                "prompt", f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                          f"request has {len(ids)} input tokens. Please reduce the length of the input messages.")
        return text, ids

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise InvalidParameterError(
                "max_tokens", f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or "
                              "completion.")
        vocab = self.model_config.vocab_size
        for token in list(params.logit_bias or {}) + list(params.stop_token_ids):
            if token >= vocab:
                raise InvalidParameterError("logit_bias" if token in (params.logit_bias or {}) else "stop_token_ids",
                                            f"token id {token} is outside the vocabulary (size {vocab})")
        return params.clone(max_tokens=max_tokens, eos_token_ids=list(self.eos_token_ids))

    def _sampling_seed(self, seed: int | None, index: int) -> int:
        # n > 1 with a seed: sample i uses seed + i, so every sample is reproducible and they differ.
        return self._rng.getrandbits(32) if seed is None else seed + index

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        for stream in state.streams:
            if not stream.detokenizer.streaming:
                stream.text += stream.detokenizer.finish()  # the text of the tokens it got ("" if it finished)
        return state.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that changed (finished ones last time;
        a FINAL_ONLY request only when it finishes)."""
        start = time.perf_counter()
        plan: SchedulerOutput = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        burst = self._burst_length(plan)
        outputs = self._step_burst(plan, burst) if burst else self._step_single(plan)
        self.stats.num_engine_steps += 1
        self.stats.step_seconds += time.perf_counter() - start
        return outputs

    def _fetch(self, array: jax.Array) -> np.ndarray:
        """The step's results on the host: the one round-trip per step, timed as the device's share of the step."""
        start = time.perf_counter()
        host = np.asarray(array)
        self.stats.device_wait_seconds += time.perf_counter() - start
        return host

    def _step_single(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """One step through the plain forward, then the sampler: prompt chunks, and decodes a burst cannot take.
        (Burst budgets are timed on fused steps only: this step runs other executables.)"""
        wants_prompt_logprobs = [self._wants_prompt_logprobs(c) for c in plan.scheduled]
        batch = self.runner.prepare(plan.scheduled, all_logits=any(wants_prompt_logprobs))
        logits = self.runner.run(batch)
        if any(wants_prompt_logprobs):
            self._record_prompt_logprobs(plan, wants_prompt_logprobs, batch, logits)
            last_rows = np.zeros(self.runner.seq_rows_for(len(batch.token_ids)), np.int32)
            last_rows[:len(plan.scheduled)] = batch.query_start[1:len(plan.scheduled) + 1] - 1
            logits = logits[last_rows]
        meta = self._metadata.build([c.seq for c in plan.scheduled], pad_to=logits.shape[0])
        sampled = sample_packed(logits, *pack(meta))
        token_ids = self._fetch(sampled.token_ids)
        self._count_prompt_tokens(plan)
        self.scheduler.on_step_done(plan)
        self.stats.num_steps += 1
        changed: dict[str, RequestState] = {}
        logprob_rows = _logprob_rows(sampled) if any(c.seq.params.logprobs is not None
                                                     for c in plan.scheduled) else None
        now = time.monotonic()
        for row, chunk in enumerate(plan.scheduled):
            if not chunk.sample or chunk.seq.is_finished:
                continue
            state = self.requests[chunk.seq.request_id]
            stream = state.streams[chunk.seq.index]
            self._append_token(stream, int(token_ids[row]), None if logprob_rows is None else logprob_rows[row])
            state.first_token_time = state.first_token_time or now
            changed[state.request_id] = state
        return self._emit_changed(changed)

    def _burst_length(self, plan: SchedulerOutput) -> int:
        """How many decode steps to run in one fused forward-and-sample device call; 0: this step needs the plain
        forward and sampler (a prompt chunk; logprobs, which are per step; penalties and a pending min_tokens, which
        change the sampling metadata every step; a runner that cannot burst).

        Up to config.decode_burst steps when no request waits, nor past any sequence's max_tokens or max_model_len,
        halved until the free blocks hold their slots; while any request streams (not FINAL_ONLY), no more than fit
        in config.decode_burst_ms at the last measured step time for this batch size."""
        if not self._bursts_possible:
            return 0
        length, streaming = self.config.decode_burst, False
        for chunk in plan.scheduled:
            seq, params = chunk.seq, chunk.seq.params
            if not _is_decode(chunk):
                return 0  # a prompt token (a one-token prompt's only step): not a decode
            if params.logprobs is not None or has_penalty(params) or seq.num_output_tokens < params.min_tokens:
                return 0
            length = min(length, params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
            streaming = streaming or params.output_kind is not RequestOutputKind.FINAL_ONLY
        if self.scheduler.num_waiting:
            return 1
        if streaming:  # the time budget bounds how long a burst holds back streamed tokens
            step_seconds = self._decode_step_seconds.get(self._decode_bucket(plan))
            if step_seconds is None:
                return 1  # this batch size's first decode step runs alone, and is timed
            fits = self.config.decode_burst_ms / 1e3 / max(step_seconds, 1e-9)  # inf: no time limit
            length = length if fits >= length else max(1, int(fits))
        bm = self.block_manager
        while length > 1 and sum(bm.num_new_blocks(chunk.seq, length) for chunk in plan.scheduled) > \
                bm.num_free_blocks:
            length //= 2  # a shorter burst whose slots fit the free blocks
        return max(length, 1)

    def _decode_bucket(self, plan: SchedulerOutput) -> int:
        """The padded batch size a decode-only step of this plan runs at (one token per sequence)."""
        return pick_bucket(self.runner.token_buckets, len(plan.scheduled))

    def _step_burst(self, plan: SchedulerOutput, length: int) -> list[RequestOutput]:
        """`length` decode steps in one device call; tokens after a sequence stops are computed but dropped."""
        for chunk in plan.scheduled if length > 1 else ():  # the scheduler gave each the first step's slot
            allocated = self.block_manager.allocate_slots(chunk.seq, length)
            assert allocated, "_burst_length checked the free blocks"
        batch = self.runner.prepare(plan.scheduled, lookahead=length - 1)
        seqs = [c.seq for c in plan.scheduled]
        meta = for_burst(self._metadata.build(seqs, self.runner.seq_rows_for(len(batch.token_ids))))
        start = time.perf_counter()
        tokens = self._fetch(self.runner.run_burst(batch, meta, length, self.config.decode_burst,
                                                   _burst_stop_ids(seqs, len(batch.seq_lens))))
        steps = int(np.count_nonzero(tokens[:, 0] >= 0))  # fewer than length once every sequence stopped
        self._decode_step_seconds[self._decode_bucket(plan)] = (time.perf_counter() - start) / steps
        self.stats.num_steps += steps
        changed: dict[str, RequestState] = {}
        for chunk, row_tokens in zip(plan.scheduled, tokens[:steps].T.tolist(), strict=False):  # padding unused
            seq = chunk.seq
            state = self.requests[seq.request_id]
            for token in row_tokens:
                if seq.is_finished:  # stopped on EOS, a stop token or a stop string inside the burst
                    break
                self.block_manager.mark_computed(seq, 1)  # the token fed at this step of the burst
                self._append_token(state.streams[seq.index], token, None)
            changed[state.request_id] = state
        return self._emit_changed(changed)

    @staticmethod
    def _wants_prompt_logprobs(chunk) -> bool:
        seq = chunk.seq
        return seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens - 1

    def _record_prompt_logprobs(self, plan: SchedulerOutput, wanted: list[bool], batch, logits) -> None:
        """Logprobs of each prompt token given the tokens before it, from this step's all-token logits."""
        next_ids = np.zeros(len(batch.token_ids), np.int32)
        for row, chunk in enumerate(plan.scheduled):
            if wanted[row]:
                start, seq = batch.query_start[row], chunk.seq
                tokens = seq.token_ids[seq.num_computed_tokens + 1: seq.num_computed_tokens + chunk.num_new_tokens + 1]
                next_ids[start: start + len(tokens)] = tokens
        chosen, top_ids, top_lps = (np.asarray(a) for a in token_logprobs(logits, next_ids))
        for row, chunk in enumerate(plan.scheduled):
            if not wanted[row]:
                continue
            seq, k = chunk.seq, chunk.seq.params.prompt_logprobs
            stream = self.requests[seq.request_id].streams[seq.index]
            if stream.prompt_logprobs is None:
                stream.prompt_logprobs = [None] * seq.num_prompt_tokens  # the first token has no context
            for i in range(chunk.num_new_tokens):
                position = seq.num_computed_tokens + i + 1  # the prompt token this row's logits predict
                if position >= seq.num_prompt_tokens:
                    break
                r = batch.query_start[row] + i
                stream.prompt_logprobs[position] = {seq.token_ids[position]: float(chosen[r]),
                                                    **dict(zip(top_ids[r, :k].tolist(), top_lps[r, :k].tolist(),
                                                               strict=True))}

    def _count_prompt_tokens(self, plan: SchedulerOutput) -> None:
        for chunk in plan.scheduled:
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens
            self.stats.num_computed_prompt_tokens += max(0, min(end, seq.num_prompt_tokens) - start)

    def _append_token(self, stream: SeqStream, token: int, logprobs: tuple | None) -> None:
        seq, params = stream.seq, stream.seq.params
        seq.append_token(token)
        self.stats.num_generated_tokens += 1
        if stream.logprobs is not None and logprobs is not None:
            chosen, top_ids, top_lps = logprobs
            top = dict(zip(top_ids[: params.logprobs], top_lps[: params.logprobs], strict=True))
            stream.logprobs.append({token: chosen, **top})
        reason, stop_reason = None, None
        ends_on_eos = not params.ignore_eos and token in self.eos_token_ids
        if (ends_on_eos or token in params.stop_token_ids) and seq.num_output_tokens > params.min_tokens:
            # The stop token's own text is not output; text held back before it (half a character) is.
            reason, stop_reason = "stop", token
            delta = stream.detokenizer.finish()
        else:
            delta = stream.detokenizer.add(token)
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
                delta += stream.detokenizer.finish()
        if params.stop:
            emit, matched = stream.stop_matcher.feed(delta)
            if matched is not None:
                reason, stop_reason = "stop", matched
            elif reason is not None:
                emit += stream.stop_matcher.flush()
            delta = emit
        stream.text += delta
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    def _emit_changed(self, changed: dict[str, RequestState]) -> list[RequestOutput]:
        return [self._emit(state) for state in changed.values() if not state.final_only or state.finished]

    def _emit(self, state: RequestState) -> RequestOutput:
        output = state.output()
        if state.finished:
            state.metrics.update(arrival_time=state.arrival_time, first_token_time=state.first_token_time or 0.0,
                                 finished_time=time.monotonic())
            output.metrics = dict(state.metrics)
            self.requests.pop(state.request_id, None)
        return output


def _burst_stop_ids(seqs: list[Sequence], rows: int) -> np.ndarray:
    """i32[rows, STOP_IDS_WIDTH]: the tokens that end each sequence (its EOS ids unless ignore_eos, then its
    stop_token_ids; the first STOP_IDS_WIDTH, -1 padding), for a burst to end on the device once all have ended."""
    stop_ids = no_stop_ids(rows)
    for row, seq in enumerate(seqs):
        ids = seq.burst_stop_ids
        if ids is None:  # the same every burst: built once per sequence
            params = seq.params
            ids = ([] if params.ignore_eos else list(params.eos_token_ids)) + list(params.stop_token_ids)
            ids = seq.burst_stop_ids = ids[:STOP_IDS_WIDTH]
        stop_ids[row, :len(ids)] = ids
    return stop_ids


def _is_decode(chunk) -> bool:
    """Whether a scheduled chunk is one sampled token after the whole prompt (a decode step)."""
    seq = chunk.seq
    return chunk.num_new_tokens == 1 and chunk.sample and seq.num_computed_tokens >= seq.num_prompt_tokens


def _logprob_rows(sampled) -> list[tuple[float, list[int], list[float]]]:
    chosen = np.asarray(sampled.logprobs).tolist()
    top_ids = np.asarray(sampled.top_ids).tolist()
    top_lps = np.asarray(sampled.top_logprobs).tolist()
    return list(zip(chosen, top_ids, top_lps, strict=True))


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
