"""`jserve chat` in a pseudo-terminal (pexpect), against the bundled demo model in-process and against a server.

The demo model writes code-shaped garbage, so the checks are mechanical: each reply streamed to the terminal is
exactly the text `LLM.chat` produces for the same greedy conversation (history, system prompt and /reset
included), replies arrive in pieces, and every failure (bad URL, server down, wrong key, a request the server
refuses) is one line of error, never a traceback.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import time

import pexpect
import pytest
from server_helpers import TEST_ENGINE_ARGS, ServerThread, wait_until

from checkpoints import DEMO_MODEL_DIR
from jserve.chat import ChatError, Conversation, LocalBackend, Options, RemoteBackend, run_chat
from jserve.cli import main
from jserve.config import EngineConfig
from jserve.sampling_params import SamplingParams
from jserve.server.settings import ServerSettings

API_KEY = "chat-test-key"
MAX_TOKENS = 24
# TEST_ENGINE_ARGS as flags: the chat's engine is then the same as llm_factory's, so greedy text must match.
ENGINE_FLAGS = ["--no-warmup", "--compilation-cache-dir", "", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "128", "--max-num-seqs", "16"]
CHAT_FLAGS = ["--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--history-file", ""]


@pytest.fixture(scope="module")
def demo_llm(llm_factory):
    return llm_factory(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS),
                       ServerSettings(api_key=API_KEY)).start()
    yield srv
    srv.stop()


def expected_reply(llm, messages: list[dict]) -> str:
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return out[0].outputs[0].text


# pexpect forks this (JAX-threaded) process; the child only execs the chat, so the fork warning does not apply.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


def spawn_chat(*args: str) -> pexpect.spawn:
    # TERM=dumb: readline then writes no terminal control sequences around the prompt.
    env = {**os.environ, "TERM": "dumb", "JAX_PLATFORMS": "cpu"}
    env.pop("JSERVE_API_KEY", None)
    return pexpect.spawn(sys.executable, ["-m", "jserve", "chat", *args, *CHAT_FLAGS], env=env, encoding="utf-8",
                         timeout=180, dimensions=(50, 500))


def send_and_read_reply(child: pexpect.spawn, *lines: str) -> str:
    """Type a message (several lines: continued with a backslash) and return the reply the terminal showed."""
    for line in lines:
        child.sendline(line)
        child.expect_exact(line + "\r\n")  # the terminal's echo of what was typed
    child.expect_exact("you> ")
    reply = child.before.replace("\r\n", "\n")
    assert reply.endswith("\n")
    return reply[:-1]


def test_local_chat_streams_the_engines_greedy_text_with_history_and_commands(demo_llm):
    child = spawn_chat("--model", str(DEMO_MODEL_DIR), *ENGINE_FLAGS)
    try:
        child.expect_exact("chatting with demo")
        child.expect_exact("you> ")
        # A two-line message: the first line ends in a backslash and the prompt becomes the continuation prompt.
        child.sendline("def add(a, b):\\")
        child.expect_exact("...> ")
        first = send_and_read_reply(child, "    return a + b")
        history = [{"role": "user", "content": "def add(a, b):\n    return a + b"}]
        assert first == expected_reply(demo_llm, history) and first.strip()
        history.append({"role": "assistant", "content": first})

        child.sendline("/system You write Python.")
        child.expect_exact("(system prompt set)")
        child.expect_exact("you> ")
        second = send_and_read_reply(child, "import sys")
        system = {"role": "system", "content": "You write Python."}
        history.append({"role": "user", "content": "import sys"})
        assert second == expected_reply(demo_llm, [system, *history])

        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact("you> ")
        third = send_and_read_reply(child, "import sys")
        assert third == expected_reply(demo_llm, [system, {"role": "user", "content": "import sys"}])

        child.sendline("/nope")
        child.expect_exact("unknown command /nope")
        child.expect_exact("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in (child.before or "")


def reader(lines: list[str]):
    """input() over these lines, then end of input."""
    remaining = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None

    return read


def test_local_backend_streams_in_pieces_and_a_stopped_reply_frees_the_engine(demo_llm, capsys):
    backend = LocalBackend(demo_llm)
    messages = [{"role": "user", "content": "class Parser:"}]
    pieces = list(backend.stream(messages, Options(temperature=0, max_tokens=MAX_TOKENS)))
    assert len(pieces) > 1 and "".join(pieces) == expected_reply(demo_llm, messages)
    # Ctrl-C mid-reply: the reply ends between engine steps (never inside one), the request is aborted (its KV
    # blocks freed), and Ctrl-C means KeyboardInterrupt again afterwards.
    stream = backend.stream(messages, Options(temperature=0, max_tokens=MAX_TOKENS))
    next(stream)
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        list(stream)
    assert not demo_llm.engine.has_unfinished_requests()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # A failed engine step is one line of error; the engine recovers and the next reply is what it was before.
    step = demo_llm.engine.step
    demo_llm.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("injected"))
    conversation = Conversation()
    try:
        assert run_chat(backend, Options(temperature=0, max_tokens=MAX_TOKENS), conversation,
                        read=reader(["class Parser:"]), write=io.StringIO().write) == 0
    finally:
        demo_llm.engine.step = step
    err = capsys.readouterr().err
    assert err == "error: an engine step failed: RuntimeError: injected; the engine recovered\n"
    assert conversation.turns == []
    assert "".join(backend.stream(messages, Options(temperature=0, max_tokens=MAX_TOKENS))) == "".join(pieces)
    # A reply abandoned by its reader (the chat closes it) is aborted too.
    stream = backend.stream(messages, Options(temperature=0, max_tokens=MAX_TOKENS))
    next(stream)
    stream.close()
    assert not demo_llm.engine.has_unfinished_requests()


def test_remote_chat_streams_from_the_server(server, demo_llm):
    child = spawn_chat("--url", server.url, "--api-key", API_KEY)
    try:
        child.expect_exact(f"chatting with {server.state.model_name}")
        child.expect_exact("you> ")
        first = send_and_read_reply(child, "def add(a, b):")
        history = [{"role": "user", "content": "def add(a, b):"}]
        assert first == expected_reply(demo_llm, history)
        history.append({"role": "assistant", "content": first})
        second = send_and_read_reply(child, "import os")
        assert second == expected_reply(demo_llm, [*history, {"role": "user", "content": "import os"}])

        # Ctrl-C while a reply streams stops it: the connection closes and the server drops the request.
        engine = server.state.engine.engine
        step = engine.step
        engine.step = lambda: (time.sleep(0.2), step())[1]  # a slow model: the reply is surely still running
        try:
            child.sendline("class Parser:")
            child.expect_exact("class Parser:\r\n")
            child.expect(r"\S")  # the reply's first text
            child.sendintr()
            child.expect_exact(" [stopped]")
            child.expect_exact("you> ")
            assert wait_until(lambda: not engine.has_unfinished_requests(), timeout=10)
        finally:
            engine.step = step
        child.sendeof()  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_remote_backend_reads_the_stream_in_pieces(server, demo_llm):
    backend = RemoteBackend(server.url + "/v1/", API_KEY)  # a trailing /v1 is accepted too
    messages = [{"role": "user", "content": "class Parser:"}]
    pieces = list(backend.stream(messages, Options(temperature=0, max_tokens=MAX_TOKENS)))
    assert len(pieces) > 1 and "".join(pieces) == expected_reply(demo_llm, messages)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("url", "key", "message"), [
    (None, "wrong-key", "the server refused the API key (401)"),
    (None, None, "the server refused the API key (401)"),
    ("http://127.0.0.1:{port}", API_KEY, "is the server running?"),
    ("localhost:8000", API_KEY, "bad URL 'localhost:8000': give http://HOST:PORT"),
])
def test_connection_errors_are_one_line_not_a_traceback(server, capsys, url, key, message):
    url = server.url if url is None else url.format(port=free_port())
    argv = ["chat", "--url", url, *(["--api-key", key] if key else [])]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_a_refused_request_is_reported_and_the_chat_goes_on(server, capsys):
    backend = RemoteBackend(server.url, API_KEY)
    conversation = Conversation()
    # More tokens than the context holds: the server answers 400, the chat says so and waits for the next line.
    assert run_chat(backend, Options(max_tokens=10**6), conversation, read=reader(["hello", "/exit"]),
                    write=io.StringIO().write) == 0
    err = capsys.readouterr().err
    assert err.startswith("error: the server answered 400:") and "Traceback" not in err
    assert conversation.turns == []  # the unanswered message is not kept
    assert RemoteBackend(server.url, API_KEY, server.state.model_name).name == server.state.model_name
    with pytest.raises(ChatError, match="serves no model 'other'; it serves: "):
        RemoteBackend(server.url, API_KEY, "other")
    with pytest.raises(ChatError, match="cannot reach"):
        RemoteBackend(f"http://127.0.0.1:{free_port()}", None)
