"""`jserve chat`: a terminal chat with a local model (in-process, through `jserve.LLM`'s engine) or a running server
(`--url`, OpenAI's /v1/chat/completions streamed over httpx).

Input: a line ending in a backslash continues on the next line (the backslash becomes a newline), so a message
can span lines. Commands: /reset (forget the conversation, keep the system prompt), /system TEXT (set the system
prompt; /system alone clears it), /help, /exit (or Ctrl-D). Ctrl-C stops a reply as it streams (the partial reply
stays in the conversation) or discards the line being typed. Errors are one line on stderr, never a traceback.

Without --url, --model and the engine flags load the model here (no --model: the default model of `jserve serve`);
with --url, --model NAME picks one of the server's models (default: the first GET /v1/models lists).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jserve.engine_args import add_engine_args

PROMPT = "you> "
CONTINUATION = "...> "
DEFAULT_HISTORY_FILE = "~/.cache/jserve/chat_history"
HELP = """commands:
  /reset        forget the conversation (the system prompt stays)
  /system TEXT  set the system prompt (/system alone clears it)
  /help         this text
  /exit         leave (Ctrl-D too)
end a line with \\ to continue the message on the next line; Ctrl-C stops a reply as it streams"""


class ChatError(Exception):
    """A failure the user can act on (server down, bad key, bad URL); printed as one line, never a traceback."""


@dataclass
class Options:
    """What every reply is sampled with."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256


@dataclass
class Conversation:
    """The messages so far; the system prompt is kept apart so /reset keeps it."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns


# ----- backends: each streams one reply's text, piece by piece -----

class LocalBackend:
    """The model in this process: requests go straight into the engine (CUMULATIVE outputs, so each step's new
    text is printed as soon as the step ends)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.name = Path(str(llm.engine.model_dir)).name
        self._ids = itertools.count()

    def stream(self, messages: list[dict], options: Options) -> Iterator[str]:
        from jserve.sampling_params import SamplingParams

        engine = self.llm.engine
        try:
            prompt = engine.tokenizer.apply_chat_template(messages, True)
        except Exception as e:  # a template that cannot render this conversation (e.g. no system role)
            raise ChatError(f"the model's chat template cannot render this conversation: {e}") from None
        params = SamplingParams(temperature=options.temperature, top_p=options.top_p, max_tokens=options.max_tokens)
        request_id = f"chat-{next(self._ids)}"
        try:
            # A conversation near the context answers up to its end, as vLLM's offline chat does.
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, cap_max_tokens=True)
        except ValueError as e:  # e.g. the conversation outgrew the context
            raise ChatError(str(e)) from None
        sent, interrupted = 0, []
        with _deferred_sigint(interrupted):
            try:
                while not interrupted:
                    for output in _step(engine):
                        if output.request_id != request_id:
                            continue
                        text = output.outputs[0].text
                        if len(text) > sent:
                            yield text[sent:]
                            sent = len(text)
                        if output.finished:
                            return
            finally:
                if engine.has_unfinished_requests():  # stopped early (Ctrl-C): free its KV blocks
                    engine.abort_request(request_id)
        raise KeyboardInterrupt


def _step(engine) -> list:
    """One engine step; a failed step becomes a ChatError once the engine has recovered (the reply is lost, the
    chat goes on), as in LLM.generate."""
    try:
        return engine.step()
    except Exception as e:
        try:
            engine.recover(e)
        except Exception as again:
            raise ChatError(f"an engine step failed ({type(e).__name__}: {e}) and the engine could not be "
                            f"restored: {again}; restart the chat") from None
        raise ChatError(f"an engine step failed: {type(e).__name__}: {e}; the engine recovered") from None


@contextlib.contextmanager
def _deferred_sigint(flag: list) -> Iterator[None]:
    """Ctrl-C while the engine steps only marks `flag`: interrupting a step halfway would leave the engine's state
    torn, so the caller stops between steps instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class RemoteBackend:
    """A jserve (or any OpenAI-compatible) server: POST /v1/chat/completions with stream=true, read as SSE."""

    def __init__(self, url: str, api_key: str | None, model: str | None = None, timeout: float = 600.0) -> None:
        try:
            import httpx
        except ImportError:  # not among jserve's own dependencies: the test and bench extras bring it
            raise ChatError("--url needs the httpx package, which is not installed: pip install httpx") from None

        self.base = _base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self.name = self._model(model)

    def _model(self, wanted: str | None) -> str:
        """The served model to ask for (`wanted`, or the first GET /v1/models lists); asking proves the URL and
        the key right up front."""
        response = self._call("GET", "/v1/models")
        try:
            names = [card["id"] for card in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise ChatError(f"{self.base}/v1/models did not answer as an OpenAI-compatible server") from None
        if wanted is None and names:
            return names[0]
        if wanted not in names:
            raise ChatError(f"the server serves no model {wanted!r}; it serves: {', '.join(names) or 'none'}")
        return wanted

    def _call(self, method: str, path: str, **kw):
        import httpx

        try:
            response = self.client.request(method, self.base + path, **kw)
        except httpx.InvalidURL as e:
            raise ChatError(f"bad URL {self.base!r}: {e}") from None
        except httpx.TransportError as e:
            raise ChatError(f"cannot reach {self.base} ({type(e).__name__}: {e}); is the server running?") from None
        if response.status_code != 200:
            raise ChatError(_http_error(response.status_code, response.text))
        return response

    def stream(self, messages: list[dict], options: Options) -> Iterator[str]:
        import httpx

        body = {"model": self.name, "messages": messages, "stream": True, "temperature": options.temperature,
                "top_p": options.top_p, "max_tokens": options.max_tokens}
        try:
            with self.client.stream("POST", self.base + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise ChatError(_http_error(response.status_code, response.read().decode("utf-8", "replace")))
                events = 0
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    events += 1
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield from _chunk_text(data)
                # An OpenAI stream always ends with [DONE]: a body that ends before it (a server or proxy that
                # went away, on a connection whose end marks the body's end) is a lost reply, not a short one.
                if not events:
                    raise ChatError(f"{self.base} answered without an event stream (no `data:` lines); it may not "
                                    "support stream: true")
                raise ChatError(f"the connection to {self.base} closed before the reply ended")
        except httpx.TransportError as e:
            raise ChatError(f"lost the connection to {self.base} ({type(e).__name__}: {e})") from None


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ChatError(f"bad URL {url!r}: give http://HOST:PORT (or https://)")
    return url[:-3] if url.endswith("/v1") else url


def _http_error(status: int, text: str) -> str:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.strip()[:200] or "no message"
    if status == 401:
        return f"the server refused the API key (401): {message}; pass the right one with --api-key"
    return f"the server answered {status}: {message}"


def _chunk_text(data: str) -> Iterator[str]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise ChatError(f"the server sent a malformed event: {data[:200]}") from None
    if "error" in chunk:  # an in-band error after the stream began
        raise ChatError(f"the server failed the reply: {chunk['error'].get('message', chunk['error'])}")
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content")
        if text:
            yield text


# ----- the terminal loop -----

def read_message(read: Callable[[str], str]) -> str:
    """One user message: lines ending in a backslash continue on the next (joined with newlines)."""
    lines, prompt = [], PROMPT
    while True:
        line = read(prompt)
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = CONTINUATION
            continue
        lines.append(line)
        return "\n".join(lines)


def run_chat(backend, options: Options, conversation: Conversation, *, read: Callable[[str], str] = input,
             write: Callable[[str], None] | None = None) -> int:
    """Read messages and stream replies until /exit or end of input; returns the exit status."""
    out = write or _write_stdout
    while True:
        try:
            message = read_message(read)
        except EOFError:
            out("\n")
            return 0
        except KeyboardInterrupt:
            out("\n")
            continue
        text = message.strip()
        if not text:
            continue
        if text.startswith("/") and "\n" not in text:
            command, _, rest = text.partition(" ")
            if command == "/exit":
                return 0
            if command == "/reset":
                conversation.turns.clear()
                out("(conversation cleared)\n")
            elif command == "/system":
                conversation.system = rest.strip() or None
                out(f"(system prompt {'set' if conversation.system else 'cleared'})\n")
            elif command == "/help":
                out(HELP + "\n")
            else:
                out(f"unknown command {command}; /help lists them\n")
            continue
        conversation.turns.append({"role": "user", "content": message})
        reply, stream = [], backend.stream(conversation.messages(), options)
        try:
            for piece in stream:
                reply.append(piece)
                out(piece)
        except ChatError as e:
            conversation.turns.pop()  # the message got no reply: leave it out, so it can be sent again
            out("\n" if reply else "")
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        except KeyboardInterrupt:
            out(" [stopped]")
        finally:
            stream.close()  # ends the request: aborted in the engine, or its connection closed
        conversation.turns.append({"role": "assistant", "content": "".join(reply)})
        out("\n")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _setup_readline(path: str) -> None:
    """Arrow-key editing, and history kept from one run to the next in `path` ("" keeps none), where readline exists."""
    try:
        import atexit
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return
    if not path:
        return
    history = Path(os.path.expanduser(path))
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except OSError:
        return
    readline.set_history_length(1000)
    atexit.register(lambda: _save_history(readline, history))


def _save_history(readline, history: Path) -> None:
    try:
        readline.write_history_file(history)
    except OSError:
        pass


# ----- the subcommand -----

def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat in the terminal with a local model or a running server (--url)",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = chat.add_argument_group("chat")
    group.add_argument("--url", default=None, help="a running server, http://HOST:PORT: chat through its "
                                                   "/v1/chat/completions instead of loading a model here")
    group.add_argument("--api-key", default=os.environ.get("JSERVE_API_KEY"),
                       help="the server's API key with --url (default: $JSERVE_API_KEY)")
    group.add_argument("--system", default=None, help="a system prompt to start with")
    group.add_argument("--temperature", type=float, default=0.7, help="every reply's temperature (default: 0.7)")
    group.add_argument("--top-p", type=float, default=1.0, help="every reply's top_p (default: 1.0)")
    group.add_argument("--max-tokens", type=int, default=256, help="longest reply, in tokens (default: 256)")
    group.add_argument("--history-file", default=DEFAULT_HISTORY_FILE,
                       help="readline history of what you typed, kept from one run to the next ('' keeps none; "
                            "default: %(default)s)")
    add_engine_args(chat)  # --model and every engine flag, for the in-process model; with --url, --model NAME picks
    # one of the server's models (default: the first GET /v1/models lists)
    chat.set_defaults(run=run_chat_command)


def run_chat_command(args: argparse.Namespace) -> int:
    # Log lines (the engine's start-up, httpx's requests) would interleave with the conversation: only warnings
    # and errors show.
    logging.getLogger().setLevel(logging.WARNING)
    options = Options(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    if not (options.temperature >= 0 and 0 < options.top_p <= 1 and options.max_tokens >= 1):
        print("jserve chat: error: need --temperature >= 0, 0 < --top-p <= 1 and --max-tokens >= 1",
              file=sys.stderr)
        return 2
    try:
        if args.url is not None:
            backend = RemoteBackend(args.url, args.api_key, args.model)
        else:
            backend = _local_backend(args)
    except ChatError as e:
        print(f"jserve chat: error: {e}", file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    if interactive:
        _setup_readline(args.history_file)
        print(f"chatting with {backend.name}; /help for commands, /exit or Ctrl-D to leave", flush=True)
    return run_chat(backend, options, Conversation(system=args.system),
                    read=input if interactive else _read_line)


def _read_line(prompt: str) -> str:
    # Piped input: no prompt echo, and end of input ends the chat.
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _local_backend(args: argparse.Namespace) -> LocalBackend:
    import dataclasses

    from jserve.engine_args import engine_config_from_args
    from jserve.llm import LLM

    config = engine_config_from_args(args)
    print(f"loading {config.model or 'the default model'} ...", file=sys.stderr, flush=True)
    return LocalBackend(LLM(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}))
