"""The XLA executor: the Flax model, attention by reference or Pallas, on one device or any mesh.

What GPUs and TPUs run. Shapes are padded to a small grid of buckets (tokens T, sequence rows S, page-table width P)
so that every step after warm-up reuses a compiled program. The KV cache is donated to the step and updated in place.
Decode bursts (a jitted `lax.while_loop` of forward-and-sample steps) run where the page table has one width.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jserve.engine.packing import PackedLayout, pack, unpack
from jserve.engine.rejection import SpecRows, SpecStep, chunk_logits_rows, logits_rows_for, rejection_sample_packed
from jserve.engine.sampler import (
    SamplingMetadata,
    for_burst,
    greedy_argmax,
    sample,
    sample_packed,
    token_logprobs,
    warmup_metadata,
)
from jserve.engine.sequence import ScheduledSeq
from jserve.executors.base import (
    Executor,
    PromptLogprobs,
    StepOutput,
    WarmupReport,
    no_stop_ids,
    pick_bucket,
    pow2_buckets,
)
from jserve.loading import LoadedModel, load_model
from jserve.lora import LoraAdapter
from jserve.models.batch import KVCache, StepBatch
from jserve.models.layers import LoraWeight
from pallas_kernels.quantized import kv_bytes_per_token_head, zeros_pages
from pallas_kernels.reference import kv_storage_dtype
from sharding import KV_CACHE_AXES, logical_sharding, replicated

logger = logging.getLogger(__name__)


def reads_only_used_pages(backend: str, platform: str | None = None) -> bool:
    """Whether this attention backend's cost is independent of the page table's width: the CPU kernel, the Triton
    kernel ("pallas" on a GPU) and the pure-JAX attention (page chunks up to the furthest position) walk each step's
    pages only as far as its sequences reach; the TPU kernel is not measured for it yet."""
    platform = platform or jax.default_backend()
    return backend in ("cpu", "reference", "pallas-interpret-gpu") or (backend == "pallas" and platform == "gpu")


def step_compiler_options(platform: str, quantized_weights: bool = False) -> dict[str, bool | int] | None:
    """XLA options for a step's executable. On a GPU, float matmuls go to cuBLAS by its heuristics: XLA's default
    autotunes a Triton GEMM for every matmul shape on the device, one compile at a time, which took an 8B model's
    warm-up past 135 s on an H200 for 2% faster batch-1 decode (4.70 against 4.80 ms a token). Quantized weights
    (int8 / fp8) keep XLA's default: cuBLAS multiplies bf16 by bf16, so each step would write a bf16 copy of every
    weight and read it back (an 8B model's batch-1 decode 14.2 ms a token on an H200, 3x bf16's), where an
    autotuned Triton GEMM converts the 1-byte weight in registers (3.00 ms, 1.58x bf16's tok/s; without autotuning
    its default tiles take 10.4 ms). The autotuning doubles the 8B warm-up (44.6 against 23.4 s)."""
    if platform != "gpu":
        return None
    if quantized_weights:
        return {"xla_gpu_enable_triton_gemm": True}
    return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


def burst_compiler_options(platform: str, quantized_weights: bool = False) -> dict[str, str | bool | int] | None:
    """XLA options for a decode burst's executable: a step's, and on a GPU, XLA's command buffers (CUDA graphs)
    take the burst's data-dependent while loop whole, as conditional nodes, where by default the host launches
    each step and reads its loop predicate back (on an H200, an 8B model's batch-1 decode 5.02 -> 4.85 ms)."""
    if platform != "gpu":
        return None
    return {**step_compiler_options(platform, quantized_weights),
            "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}


def holds_quantized_weights(params: list) -> bool:
    """Whether any parameter is stored in a 1-byte dtype (int8 or fp8 weights: --quantization, a W8A16
    checkpoint, a GGUF file's quantized tensors)."""
    dtypes = {jnp.dtype(p.dtype) for p in params if hasattr(p, "dtype")}
    return any(d.itemsize == 1 and d != jnp.bool_ for d in dtypes)


def kv_bytes_per_block(config, block_size: int, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block over every layer, K and V (K alone where the values are read from the key pages), a
    quantized cache's scales included."""
    per_token_head = kv_bytes_per_token_head(config.head_dim, dtype, kv_cache_dtype)
    arrays = 1 if config.values_in_key_pages else 2
    return arrays * config.num_layers * block_size * config.num_kv_heads * per_token_head


class XlaExecutor(Executor):
    name = "xla"
    # The most tokens a lone decode step is padded to: XLA CPU matmuls with M = 1 are up to 10x slower per row.
    smallest_token_bucket = 8
    argmax: Callable[[jax.Array], jax.Array] = staticmethod(greedy_argmax)  # the sampler's, static in its trace

    @classmethod
    def load(cls, model_dir: str | Path, *, dtype: str, attention_backend: str, mesh: Mesh | None = None,
             load_format: str = "auto", quantization: str | None = None,
             max_model_len: int | None = None, lora: tuple[int, int] = (0, 0), pooling: bool = False) -> LoadedModel:
        """The model's parameters on the devices (sharded over the mesh by the rules table); quantization: the
        decoder layers' matrices quantized at load (jserve.models.quantization); lora: (max_loras, max_lora_rank)
        adapter slots in every decoder projection (none where 0); pooling: an embedding model (no LM head)."""
        return load_model(model_dir, dtype, attention_backend, mesh=mesh, load_format=load_format,
                          quantization=quantization, max_model_len=max_model_len, lora=lora, pooling=pooling)

    def __init__(self, model: LoadedModel, *, dtype: str, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, mesh: Mesh | None = None,
                 kv_cache_dtype: str = "auto"):
        """mesh: the [data=1, model] mesh the model was loaded onto (None: one device, no sharding).
        kv_cache_dtype: "auto" (K/V in `dtype`) | "int8" | "fp8": each layer's K and V a QuantizedPages
        (pallas_kernels/quantized.py), quantized as written and read by attention as stored."""
        self.config = model.config
        self.graphdef = model.graphdef
        self.attention_backend = model.attention_backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * block_size
        self.mesh = mesh
        self.max_num_batched_tokens = max_num_batched_tokens
        # The step takes the parameters as a flat list: flattening an nnx.State runs Python code per leaf (0.36 ms
        # a step for the 135M model's 182 arrays), a list flattens in C++. The tree is rebuilt inside the trace.
        tree = self._param_tree(model)
        self.params, self._params_tree = jax.tree.flatten(tree)
        # Where each LoRA adapter stack sits in the list: (module path, "lora_a" | "lora_b") -> index
        stacks = {id(var[...]): tuple(path) for path, var in nnx.to_flat_state(model.state)
                  if isinstance(var, LoraWeight)} if tree is model.state else {}
        self._lora_params = {(path[:-1], path[-1]): i for i, p in enumerate(self.params)
                             if (path := stacks.get(id(p))) is not None}
        self._lora_setters: dict[Any, Callable] = {}
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        storage = kv_storage_dtype(dtype, jax.default_backend())
        self._kv_shape, self._kv_storage = shape, storage
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        platform, quantized = jax.default_backend(), holds_quantized_weights(self.params)
        if mesh is None:
            # Committed to the device: a step's outputs are then committed whichever way the weights were placed,
            # and jit keys its cache on that (the sampler compiled at warm-up must be the one steps call).
            device = jax.devices()[0]
            self.params = [jax.device_put(p, device) if isinstance(p, jax.Array) and not p.committed else p
                           for p in self.params]
            # The cache too: a burst returns it committed, and a step compiled for an uncommitted one would
            # compile again for the first step after a burst.
            self.kv_cache = self._allocate_kv_cache()
            self._step = jax.jit(self._packed_forward, donate_argnums=(1,), static_argnums=(3,),
                                 compiler_options=step_compiler_options(platform, quantized))
        else:
            self.kv_cache = self._allocate_kv_cache()
            # The cache keeps its layout across steps and logits come back whole (the sampler runs unsharded);
            # parameters keep the shardings they were loaded with, and GSPMD propagates them through the step.
            cache_shardings = jax.tree.map(lambda a: a.sharding, self.kv_cache)
            self._step = jax.jit(self._packed_forward, donate_argnums=(1,), static_argnums=(3,),
                                 out_shardings=(cache_shardings, replicated(mesh)),
                                 compiler_options=step_compiler_options(platform, quantized))
        smallest = self.smallest_token_bucket
        self.token_buckets = pow2_buckets(min(smallest, max_num_batched_tokens), max_num_batched_tokens)
        self.max_seq_rows = min(max_num_seqs, max_num_batched_tokens)
        # Attention that reads only the pages its sequences reach (reads_only_used_pages) takes one full-width table
        # for every step: 7x fewer shapes, and decode bursts, which need one width for all their steps. Otherwise
        # the width is bucketed too.
        max_pages = math.ceil(max_model_len / block_size)
        self.page_buckets = [max_pages] if reads_only_used_pages(self.attention_backend) \
            else pow2_buckets(1, max_pages)
        # The batch (and a burst's sampling metadata and step count) travel packed into one array; the packing
        # layout, which holds every shape and the metadata's static flags, keys the executables compiled ahead.
        self._compiled: dict[PackedLayout, Callable] = {}
        # A decode burst runs several steps in one call, so it needs one page width for all of them.
        self.supports_burst = mesh is None and len(self.page_buckets) == 1
        self._burst = jax.jit(self._packed_burst, donate_argnums=(1,), static_argnums=(3, 4),
                              compiler_options=burst_compiler_options(platform, quantized))
        self._compiled_bursts: dict[tuple[PackedLayout, int], Callable] = {}  # by (layout, max_steps)

    # ----- what a subclass may hold differently -----

    def _param_tree(self, model: LoadedModel) -> Any:
        """The pytree of arrays the step takes (flattened to a list) and _forward gets back."""
        return model.state

    def _allocate_kv_cache(self) -> KVCache:
        """A zeroed cache of this executor's shape and placement: committed to the one device, or each device of the
        mesh holding only its own KV heads (never the whole cache on one device)."""
        shape, storage = self._kv_shape, self._kv_storage
        if self.mesh is None:
            return jax.device_put(self._new_kv_cache(shape, storage), jax.devices()[0])
        zeros = jax.jit(lambda: jnp.zeros(shape, storage),
                        out_shardings=logical_sharding(self.mesh, KV_CACHE_AXES, shape))
        if self.kv_cache_dtype != "auto":  # values sharded like an unquantized cache, scales by their KV heads
            def zeros(mesh=self.mesh):
                def sharded_zeros(array_shape, dtype):
                    axes = KV_CACHE_AXES[:len(array_shape)]
                    return jax.jit(lambda: jnp.zeros(array_shape, dtype),
                                   out_shardings=logical_sharding(mesh, axes, array_shape))()
                return zeros_pages(shape, self.dtype, self.kv_cache_dtype, jax.default_backend(), sharded_zeros)
        return self._kv_cache_of(zeros)

    def _kv_cache_of(self, zeros: Callable[[], object]) -> KVCache:
        """A cache of one `zeros()` a layer for K and one for V; no V where the values are read from the key pages
        (latent attention), whose layers get None."""
        layers = self.config.num_layers
        values = [None] * layers if self.config.values_in_key_pages else [zeros() for _ in range(layers)]
        return KVCache(k=[zeros() for _ in range(layers)], v=values)

    def reset_kv_cache(self) -> None:
        """Replace the KV cache with a zeroed one of the same shapes and shardings. A step donates the cache, so
        after a step that failed its arrays may be deleted; those that survive are freed first, so the new cache
        never needs room for two."""
        for array in jax.tree.leaves(self.kv_cache):
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.delete()
        self.kv_cache = None
        self.kv_cache = self._allocate_kv_cache()

    def _new_kv_cache(self, shape: tuple[int, ...], dtype: jnp.dtype) -> KVCache:
        """A single device's cache: one [num_blocks, block_size, num_kv_heads, head_dim] array a layer (or a
        QuantizedPages of that shape)."""
        if self.kv_cache_dtype != "auto":
            return self._kv_cache_of(lambda: zeros_pages(shape, self.dtype, self.kv_cache_dtype, jax.default_backend()))
        return self._kv_cache_of(lambda: jnp.zeros(shape, dtype))

    def _forward(self, params: list, kv_cache: KVCache, batch: StepBatch) -> tuple[KVCache, jax.Array]:
        """The model over one batch (traced) -> (kv_cache, logits [S, V] float32)."""
        return self._call_model(nnx.merge(self.graphdef, jax.tree.unflatten(self._params_tree, params)),
                                kv_cache, batch)

    def _call_model(self, model: nnx.Module, kv_cache: KVCache, batch: StepBatch) -> tuple[KVCache, jax.Array]:
        if self.mesh is None:
            return model(kv_cache, batch)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # kernels split over heads (sharding/kernels.py)
            return model(kv_cache, batch)

    # ----- traced steps -----

    def _packed_forward(self, params: list[jax.Array], kv_cache: KVCache, packed: jax.Array,
                        layout: PackedLayout) -> tuple[KVCache, jax.Array]:
        return self._forward(params, kv_cache, unpack(packed, layout))

    def _packed_burst(self, params: list[jax.Array], kv_cache: KVCache, packed: jax.Array, layout: PackedLayout,
                      max_steps: int) -> tuple[KVCache, jax.Array]:
        batch, meta, stop_ids, num_steps = unpack(packed, layout)
        return self._burst_steps(params, kv_cache, batch, meta, stop_ids, num_steps, max_steps)

    def _burst_steps(self, params: list[jax.Array], kv_cache: KVCache, batch: StepBatch, meta: SamplingMetadata,
                     stop_ids: jax.Array, num_steps: jax.Array, max_steps: int) -> tuple[KVCache, jax.Array]:
        """Up to num_steps (<= max_steps, traced: one executable serves every length) decode steps, each feeding the
        tokens it samples to the next, ending early once every sequence row has sampled one of its stop_ids
        (i32[S, STOP_IDS_WIDTH], -1 padding) -> (kv_cache, i32[max_steps, S]; rows of steps not run are -1).

        Step i samples as the i-th of that many single steps would (meta.steps + i keys the draw)."""
        real = jnp.arange(batch.token_ids.shape[0]) < batch.query_start[-1]  # [T] tokens before the padding

        def one_step(carry):
            i, kv_cache, batch, tokens, stopped = carry
            # Tied to the loop-carried batch, the weights are not loop-invariant: XLA would otherwise hoist the
            # embedding table's bitcast (gathered as uint16 bits) out of the loop and copy all 56 MB every call.
            step_params, batch = jax.lax.optimization_barrier((params, batch))
            kv_cache, logits = self._forward(step_params, kv_cache, batch)
            sampled = sample(logits, dataclasses.replace(meta, steps=meta.steps + i), self.argmax).token_ids  # [S]
            stopped = stopped | jnp.any(sampled[:, None] == stop_ids, axis=1)
            return i + 1, kv_cache, self._next_decode_batch(batch, sampled, real), tokens.at[i].set(sampled), stopped

        def more_steps(carry) -> jax.Array:
            i, *_, stopped = carry
            return (i < num_steps) & ~jnp.all(stopped)

        tokens = jnp.full((max_steps, batch.seq_lens.shape[0]), -1, jnp.int32)
        stopped = batch.seq_lens == 0  # [S] padding rows never hold a burst
        _, kv_cache, _, tokens, _ = jax.lax.while_loop(more_steps, one_step,
                                                       (jnp.int32(0), kv_cache, batch, tokens, stopped))
        return kv_cache, tokens

    def _next_decode_batch(self, batch: StepBatch, sampled: jax.Array, real: jax.Array) -> StepBatch:
        """The decode batch one token later: each real token (one per sequence row) is replaced by its row's sample,
        one position on, in the slot its page holds for that position; padding stays padding."""
        positions = jnp.where(real, batch.positions + 1, 0)
        pages = batch.page_table[batch.token_seq, positions // self.block_size]
        return dataclasses.replace(
            batch, token_ids=jnp.where(real, sampled[batch.token_seq], 0), positions=positions,
            slot_mapping=jnp.where(real, pages * self.block_size + positions % self.block_size, self.num_slots),
            seq_lens=jnp.where(batch.seq_lens > 0, batch.seq_lens + 1, 0))

    # ----- the executor interface -----

    def execute(self, batch: StepBatch, meta: SamplingMetadata | Callable[[], SamplingMetadata],
                prompt_next_ids: np.ndarray | None = None, spec: SpecStep | None = None) -> StepOutput:
        logits = self.run(batch)  # dispatched: the device computes while the host makes a deferred meta
        if callable(meta):
            meta = meta()
        prompt = None
        if prompt_next_ids is not None:  # logits for every token: the prompt's logprobs, then each row's last
            prompt = PromptLogprobs(*(np.asarray(a) for a in token_logprobs(logits, prompt_next_ids)))
            logits = logits[np.maximum(batch.query_start[1:] - 1, 0) if spec is None else spec.logits_rows]
        if spec is not None:  # the drafts' rows verified by rejection sampling (jserve.engine.rejection)
            sampled = rejection_sample_packed(logits, *pack((meta, spec.rows)), self.argmax, spec.draft_probs)
            return StepOutput(sampled, prompt)
        return StepOutput(sample_packed(logits, *pack(meta), self.argmax), prompt)

    def execute_burst(self, batch: StepBatch, meta: SamplingMetadata, num_steps: int, max_steps: int,
                      stop_ids: np.ndarray | None = None) -> jax.Array:
        """The batch's sequences must hold slots for num_steps tokens (prepare with lookahead=num_steps - 1)."""
        if stop_ids is None:
            stop_ids = no_stop_ids(len(batch.seq_lens))
        packed, layout = pack((batch, meta, stop_ids, np.int32(num_steps)))
        compiled = self._compiled_bursts.get((layout, max_steps))
        if compiled is None:  # a shape or sampler variant not compiled ahead goes through jit
            self.kv_cache, tokens = self._burst(self.params, self.kv_cache, packed, layout, max_steps)
        else:
            self.kv_cache, tokens = compiled(self.params, self.kv_cache, packed)
        return tokens

    def set_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write an adapter into one slot of every projection's stacks (None: empty it). Each stack keeps its
        placement; the update is one small jitted call per stack shape (compiled at warm-up)."""
        for (module, which), index in self._lora_params.items():
            current = self.params[index]
            held = adapter.modules.get(module) if adapter is not None else None
            value = np.zeros(current.shape[1:], np.float32) if held is None else held[which == "lora_b"]
            setter = self._lora_setters.get(current.sharding)
            if setter is None:
                setter = self._lora_setters[current.sharding] = jax.jit(
                    lambda stack, value, slot: stack.at[slot].set(value), donate_argnums=(0,),
                    out_shardings=current.sharding)
            self.params[index] = setter(current, value, np.int32(slot))

    def seq_rows_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, pick_bucket(pow2_buckets(1, self.max_seq_rows), self.max_seq_rows))

    def prepare(self, chunks: Seq[ScheduledSeq], all_logits: bool = False, lookahead: int = 0,
                num_tokens_bucket: int | None = None) -> StepBatch:
        """Flatten the scheduled chunks into one padded ragged batch (host-side numpy, then one transfer).

        With all_logits the step returns logits for every token (for prompt logprobs), not one row per sequence.
        lookahead: tokens past this step the page table must reach (a decode burst's later steps). A chunk's draft
        tokens (speculative decoding) end its tokens, and it gets a logits row for each of them after its last known
        token's, rows back to back (jserve.engine.rejection.logits_rows_for pads them). num_tokens_bucket: the token
        bucket to pad to, if larger than the chunks need (a draft model's decode steps keep one shape a round).
        """
        num_tokens = sum(c.num_new_tokens for c in chunks)
        t_pad = pick_bucket(self.token_buckets, max(num_tokens, num_tokens_bucket or 0))
        s_pad = self.seq_rows_for(t_pad)
        pages_needed = max(math.ceil((c.seq.num_computed_tokens + c.num_new_tokens + lookahead) / self.block_size)
                           for c in chunks)
        p_pad = pick_bucket(self.page_buckets, pages_needed)
        token_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, self.num_slots, np.int32)  # out of range: padding writes are dropped
        token_seq = np.zeros(t_pad, np.int32)
        page_table = np.zeros((s_pad, p_pad), np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        query_start = np.zeros(s_pad + 1, np.int32)
        logits_indices = np.zeros(s_pad, np.int32)
        lora_slots = None
        if self.config.max_loras:  # each row's adapter slot (-1: none)
            lora_slots = np.full(s_pad, -1, np.int32)
            lora_slots[:len(chunks)] = [c.seq.lora_slot for c in chunks]
        offset, block_size = 0, self.block_size
        for row, chunk in enumerate(chunks):
            seq, n = chunk.seq, chunk.num_new_tokens
            start, blocks = seq.num_computed_tokens, seq.block_table
            drafts = chunk.draft_token_ids
            if drafts:  # the last known token, then the drafts it is to verify
                pos = np.arange(start, start + n, dtype=np.int32)
                token_ids[offset] = seq.token_at(start)
                token_ids[offset + 1: offset + n] = drafts
                positions[offset: offset + n] = pos
                slot_mapping[offset: offset + n] = (np.asarray(blocks, np.int32)[pos // block_size] * block_size
                                                    + pos % block_size)
                token_seq[offset: offset + n] = row
            elif n == 1:  # a decode: scalar writes (per-row numpy calls would cost more than the row's work)
                token_ids[offset] = seq.token_at(start)
                positions[offset] = start
                slot_mapping[offset] = blocks[start // block_size] * block_size + start % block_size
                token_seq[offset] = row
            else:
                pos = np.arange(start, start + n, dtype=np.int32)
                token_ids[offset: offset + n] = seq.token_ids[start: start + n]
                positions[offset: offset + n] = pos
                slot_mapping[offset: offset + n] = (np.asarray(blocks, np.int32)[pos // block_size] * block_size
                                                    + pos % block_size)
                token_seq[offset: offset + n] = row
            num_pages = min(len(blocks), p_pad)
            page_table[row, :num_pages] = blocks[:num_pages]
            seq_lens[row] = start + n
            offset += n
            query_start[row + 1] = offset
            logits_indices[row] = offset - 1
        query_start[len(chunks) + 1:] = offset
        if all_logits:
            logits_indices = np.arange(t_pad, dtype=np.int32)
        elif any(c.draft_token_ids for c in chunks):
            rows = chunk_logits_rows(query_start, np.array([len(c.draft_token_ids) for c in chunks], np.int32))
            logits_indices = np.zeros(logits_rows_for(len(rows), t_pad, s_pad), np.int32)
            logits_indices[:len(rows)] = rows
        return StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                         token_seq=token_seq, page_table=page_table, seq_lens=seq_lens,
                         query_start=query_start, logits_indices=logits_indices, lora_slots=lora_slots)

    def run(self, batch: StepBatch) -> jax.Array:
        """Run one step without sampling; returns float32 logits [S, V] (rows past the real sequences are padding)."""
        packed, layout = pack(batch)
        compiled = self._compiled.get(layout)
        if compiled is None:  # a shape not compiled ahead goes through jit
            self.kv_cache, logits = self._step(self.params, self.kv_cache, packed, layout)
        else:
            self.kv_cache, logits = compiled(self.params, self.kv_cache, packed)
        return logits

    def compile_ahead(self, batches: list[StepBatch], bursts: Seq[tuple[StepBatch, SamplingMetadata, int]] = (),
                      workers: int | None = None) -> list[tuple[int, int]]:
        """Compile the step for each batch's shapes, and each (batch, meta, max_steps) burst, without running them;
        returns the (rows, vocab) of each step's logits.

        Tracing runs one shape at a time; XLA compiles several at once on worker threads (it releases the GIL).
        Only a single-device step is compiled this way: sharded steps warm up by running (see warmup).
        """
        lowered = [self.lower_step(b) for b in batches] + [self.lower_burst(*burst) for burst in bursts]
        workers = workers or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers, thread_name_prefix="jserve-compile") as pool:
            compiled = list(pool.map(lambda item: (item[0], item[1].compile()), lowered))
        steps, burst_executables = compiled[:len(batches)], compiled[len(batches):]
        self._compiled.update(steps)
        self._compiled_bursts.update(burst_executables)
        return [tuple(exe.out_info[1].shape) for _, exe in steps]

    def warmup(self, decode_burst: int, speculative: bool = False, draft_probs: bool = False) -> WarmupReport:
        if self._lora_params:  # the adapter slots' writes, so a request's first adapter compiles nothing
            self.set_lora(0, None)
        batches = list(self.warmup_batches())
        if speculative:  # steps whose drafts' logits rows outnumber the sequence rows take one row per token
            batches += list(self.speculative_batches())
        # an embedding model's steps return hidden states and sample nothing: no bursts, no sampler
        pooling = self.config.pooling
        bursts = [] if pooling else [(b, for_burst(warmup_metadata(len(b.seq_lens))[0]), decode_burst)
                                     for b in self.burst_batches()]
        vocab = self.config.hidden_size if pooling else self.config.vocab_size
        rows = [] if pooling else sorted({len(b.seq_lens) for b in batches})
        spec_rows = self.speculative_logits_rows() if speculative and not pooling else []
        if self.mesh is None:
            # The sampler's variants compile on a thread of their own while the steps compile (XLA releases the
            # GIL): its logits are (rows, vocab) for each token bucket's rows.
            with ThreadPoolExecutor(1, thread_name_prefix="jserve-sampler") as pool:
                sampler = pool.submit(lambda: [self._warm_sampler((n, vocab)) for n in rows]
                                      + [self._warm_rejection_sampler((n, vocab), draft_probs) for n in spec_rows])
                logits_shapes = set(self.compile_ahead(batches, bursts))
                sampler.result()
            assert logits_shapes == {(len(b.logits_indices), vocab) for b in batches}, logits_shapes
        else:  # a sharded (or multi-process) step compiles on its first run, in lockstep on every process
            logits_shapes = {tuple(self.run(batch).shape) for batch in batches}
            for n in rows:
                self._warm_sampler((n, vocab))
            for n in spec_rows:
                self._warm_rejection_sampler((n, vocab), draft_probs)
        return WarmupReport(step_shapes=len(batches), burst_shapes=len(bursts))

    def _warm_sampler(self, shape: tuple[int, int]) -> None:
        # Committed to the step's device(s) as a step's logits are: jit keys its cache on committedness, so
        # uncommitted warm-up logits would leave the first real step of each shape to compile the sampler again.
        logits = jax.device_put(jnp.zeros(shape, jnp.float32), self.devices_of_logits())
        for meta in warmup_metadata(shape[0]):
            jax.block_until_ready(sample_packed(logits, *pack(meta), self.argmax))

    def _warm_rejection_sampler(self, shape: tuple[int, int], draft_probs: bool) -> None:
        # A speculative step's sampler, for_burst's one variant (the engine sends that metadata), no drafts; also with
        # a draft model's distributions where the engine has one (its greedy rounds send none).
        logits = jax.device_put(jnp.zeros(shape, jnp.float32), self.devices_of_logits())
        rows = SpecRows(draft_ids=np.full(shape[0], -1, np.int32), seg_start=np.arange(shape[0], dtype=np.int32))
        meta = for_burst(warmup_metadata(shape[0])[0])
        for probs in [None, logits] if draft_probs else [None]:
            jax.block_until_ready(rejection_sample_packed(logits, *pack((meta, rows)), self.argmax, probs))

    def speculative_logits_rows(self) -> list[int]:
        """Every count of logits rows a speculative step may have (jserve.engine.rejection.logits_rows_for)."""
        batches = [*self.warmup_batches(), *self.speculative_batches()]
        return sorted({len(b.logits_indices) for b in batches})

    def devices_of_logits(self) -> jax.sharding.Sharding:
        """Where a step's logits live: the one device, or replicated over the mesh."""
        return jax.sharding.SingleDeviceSharding(jax.devices()[0]) if self.mesh is None else replicated(self.mesh)

    def lower_step(self, batch: StepBatch) -> tuple[PackedLayout, jax.stages.Lowered]:
        """The step for this batch's shapes, lowered (not compiled), and the key run() finds it by."""
        packed, layout = pack(batch)
        return layout, self._step.lower(self.params, self.kv_cache, packed, layout)

    def lower_burst(self, batch: StepBatch, meta: SamplingMetadata,
                    max_steps: int) -> tuple[tuple[PackedLayout, int], jax.stages.Lowered]:
        """A burst of up to max_steps for this batch and metadata, lowered, and the key execute_burst() finds it by."""
        packed, layout = pack((batch, meta, no_stop_ids(len(batch.seq_lens)), np.int32(max_steps)))
        return (layout, max_steps), self._burst.lower(self.params, self.kv_cache, packed, layout, max_steps)

    def burst_batches(self):
        """The warm-up batches a decode burst can take: the token bucket of every count of decoding sequences up to
        the sequence rows (with fewer rows than the smallest token bucket, that bucket with fewer rows)."""
        if not self.supports_burst:
            return iter(())
        buckets = {pick_bucket(self.token_buckets, n) for n in range(1, self.max_seq_rows + 1)}
        return (b for b in self.warmup_batches() if len(b.token_ids) in buckets)

    def speculative_batches(self):
        """The warm-up batches of speculative steps that need more logits rows than sequence rows: one per token."""
        for batch in self.warmup_batches():
            t_pad = len(batch.token_ids)
            if len(batch.seq_lens) < t_pad:
                yield dataclasses.replace(batch, logits_indices=np.zeros(t_pad, np.int32))

    def warmup_batches(self):
        """One all-padding batch per (tokens, pages) bucket: compiling them all up front means no step recompiles."""
        for t_pad in self.token_buckets:
            s_pad = self.seq_rows_for(t_pad)
            for p_pad in self.page_buckets:
                yield StepBatch(
                    token_ids=np.zeros(t_pad, np.int32), positions=np.zeros(t_pad, np.int32),
                    slot_mapping=np.full(t_pad, self.num_slots, np.int32), token_seq=np.zeros(t_pad, np.int32),
                    page_table=np.zeros((s_pad, p_pad), np.int32), seq_lens=np.zeros(s_pad, np.int32),
                    query_start=np.zeros(s_pad + 1, np.int32), logits_indices=np.zeros(s_pad, np.int32),
                    lora_slots=np.full(s_pad, -1, np.int32) if self.config.max_loras else None)
