"""`jserve serve`: the OpenAI-compatible server on uvicorn.

SIGTERM (or Ctrl-C) stops accepting connections, lets running requests finish for up to --shutdown-timeout
seconds, aborts what is left, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

from jserve.arg_types import integer, non_negative_float, positive_float
from jserve.engine_args import add_engine_args, engine_config_from_args
from jserve.server.settings import (
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STEP_FAILURES,
    DEFAULT_STEP_FAILURE_WINDOW_S,
    ServerSettings,
)

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
EXIT_LOAD_FAILED = 2
EXIT_ENGINE_FAILED = 3  # the engine failed for good (recovery failed, or too many failed steps)
EXIT_LEADER_FAILED = 4  # a multi-host follower lost its leader


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible streaming server (the demo model without --model)")
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
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: --model, or jserve-demo)")
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
    group.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                       help='how tool_choice "auto" finds tool calls in the output: hermes (<tool_call> JSON blocks: '
                            'Hermes, Qwen) or llama3_json (a JSON object: Llama 3.1+); without it only "required" '
                            "and named tool choices are served")
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jserve.server.app import build_app

    settings = ServerSettings(served_model_name=args.served_model_name, api_key=args.api_key,
                              api_keys_file=args.api_keys_file,
                              prefix_cache_salt_by_key=args.prefix_cache_salt_by_key,
                              max_queue_delay=args.max_queue_delay,
                              max_queued_requests=args.max_queued_requests, tool_call_parser=args.tool_call_parser,
                              max_request_bytes=args.max_request_bytes, max_step_failures=args.max_step_failures,
                              step_failure_window_s=args.step_failure_window)
    config = engine_config_from_args(args)
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
    app = build_app(config, settings, on_load_error=on_load_error)
    app.state.server.on_fatal = on_fatal
    server = _server_class(uvicorn)(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                                           log_config=None))
    logger.info("jserve serving on http://%s:%d (model loads in the background; GET /health says when ready)",
                args.host, args.port)
    server.run()
    if failed:
        logger.error("jserve: the model failed to load: %s", failed[0])
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
