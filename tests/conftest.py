"""Shared fixtures: tiny Hugging Face checkpoints (with a tokenizer) built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

# Tests run on the CPU; keep XLA from grabbing every core's worth of threads for tiny ops.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' tiny models spend far longer in XLA's compiler than in the code it emits: LLVM's backend at -O0
# compiles a quarter faster, and the HLO (what the tests check) is the same. Processes the tests start inherit it.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_models import build_model, save_tokenizer  # noqa: E402

# The reference models are tiny: one torch thread is as fast, and it cannot stall behind a busy second core.
torch.set_num_threads(1)


# The slowest files, slowest first (seconds summed over their tests in a --durations=0 run on 2 cores). The two
# workers take whole files (--dist loadfile) in collection order (--no-loadscope-reorder): the longest go first so
# that the last files handed out are short and both workers finish together (xdist's own order, by test count, ends
# on files of few long tests). A file's rank matters, not its exact figure; files not named follow alphabetically.
SLOWEST_FILES = ("test_engine.py", "test_parity.py", "test_gguf.py", "test_draft_model.py", "test_kernels.py",
                 "test_sharding.py", "test_cpu_kernels_isa.py", "test_cpu_int8.py", "test_ray_serve.py",
                 "test_gpu_check.py", "test_quantization.py", "test_speculative.py", "test_kv_quant.py",
                 "test_orbax.py", "test_dummy_weights.py", "test_lora.py", "test_fuzz.py", "test_moe.py",
                 "test_notebooks.py", "test_cpu_kernels.py", "test_structured_outputs.py", "test_faults.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session", autouse=True)
def _shared_compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the run: its two workers and the processes they start compile a
    step shape once between them (tests build many engines of the same tiny models, and each module's end clears
    jax's in-memory caches). Engines given compilation_cache_dir="" leave jax's setting alone, so they use it;
    compile counts still see every compilation (jax reports a cache hit as a backend compile). About 10% of the
    suite's time."""
    import jax

    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-cache"
    cache.mkdir(exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Factory: a saved random-weight model of a given variant, with the tiny tokenizer beside it."""
    cache: dict[tuple, Path] = {}

    def make(variant: str = "llama", **overrides) -> Path:
        key = (variant, repr(sorted(overrides.items())))  # repr: an override may be a dict (rope_scaling)
        if key not in cache:
            out = tmp_path_factory.mktemp(variant)
            build_model(variant, out, **overrides)
            save_tokenizer(out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def kernel_build(tmp_path_factory):
    """Factory: cpu_kernels.build with a tuple of compiler flags, once a session for each tuple (test_cpu_int8's
    AVX2 build is test_cpu_kernels_isa's): the library's path, or the build's KernelUnavailable raised again.
    Thread-safe: the ISA tests build two variants at a time."""
    import concurrent.futures
    import threading

    import cpu_kernels

    lock = threading.Lock()
    builds: dict[tuple[str, ...], concurrent.futures.Future] = {}

    def build(flags: tuple[str, ...]) -> Path:
        with lock:
            owner = flags not in builds
            if owner:
                builds[flags] = concurrent.futures.Future()
        future = builds[flags]
        if owner:
            try:
                future.set_result(cpu_kernels.build(tmp_path_factory.mktemp("kernels") / "libjserve_cpu.so", flags))
            except BaseException as error:  # every caller of these flags sees the build's own error
                future.set_exception(error)
        return future.result()

    return build


LLM_CACHE_SIZE = 12


@pytest.fixture(scope="session")
def llm_factory():
    """Factory: an LLM over a model directory with small test-sized engine settings (cached per settings).

    The cache keeps the LLM_CACHE_SIZE most recently used: every compiled executable holds memory mappings of its
    own, and with every LLM of the run kept the process reaches the kernel's limit (vm.max_map_count, 65,530), where
    a compile fails and the failure's C++ exception segfaults in the unwinder."""
    import collections
    import gc

    from jserve import LLM

    cache: collections.OrderedDict[tuple, LLM] = collections.OrderedDict()

    def make(model_dir: Path, **engine_args) -> LLM:
        settings = dict(max_model_len=512, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=128,
                        max_num_seqs=16, warmup=False, compilation_cache_dir="")
        settings.update(engine_args)
        key = (str(model_dir), tuple(sorted(settings.items())))
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = LLM(str(model_dir), **settings)
            if len(cache) > LLM_CACHE_SIZE:
                cache.popitem(last=False)
                gc.collect()  # the evicted engine's cycles, and with them its executables and their mappings
        return cache[key]

    return make


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_executables():
    """After each test module (its servers already stopped), jax's caches of compiled executables are cleared and
    the garbage collected: each executable holds memory mappings, and a run that keeps them all reaches the
    kernel's vm.max_map_count (see llm_factory). An LLM that outlives its module compiles its steps again."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
