"""API keys from a file, per-key rate limits and priorities, load shedding and request deadlines, against live
servers seen through the official openai client and httpx."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time

import httpx
import openai
import pytest
from server_helpers import TEST_ENGINE_ARGS, ServerThread, metric_values, wait_until

from jserve.cli import main as jserve_main
from jserve.config import EngineConfig
from jserve.server.auth import ApiKeysFileError, load_api_keys, parse_api_keys
from jserve.server.limits import Limits
from jserve.server.protocol import APIError
from jserve.server.settings import ServerSettings

VOCAB = 512  # tests/hf_models.py: stop_token_ids of every id ends a request after one token
KEYS = [
    {"id": "counted", "key": "sk-counted", "requests_per_minute": 6, "tokens_per_minute": 600},
    {"id": "burst", "key": "sk-burst", "requests_per_minute": 120, "requests_burst": 1},
    {"id": "limited", "key": "sk-limited", "max_concurrent_requests": 1, "priority": 10},
    {"id": "vip", "key_sha256": hashlib.sha256(b"sk-vip").hexdigest()},
    {"id": "other", "key": "sk-other"},
]
PROMPT = "The quick brown fox jumps over the lazy dog."


def _write(tmp_path, name: str, content: str):
    path = tmp_path / name
    path.write_text(content)
    return path


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    keys = _write(tmp_path_factory.mktemp("keys"), "keys.json", json.dumps({"keys": KEYS}))
    config = EngineConfig(model=str(model_dir), **{**TEST_ENGINE_ARGS, "decode_burst": 1})
    settings = ServerSettings(api_key="sk-plain", api_keys_file=str(keys), prefix_cache_salt_by_key=True)
    srv = ServerThread(config, settings).start()
    yield srv
    srv.stop()


def client(server, key: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, **{"max_retries": 0, "timeout": 60, **kwargs})


def complete_raw(c: openai.OpenAI, **kwargs):
    args = dict(model=None, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    args.update(kwargs)
    if args["model"] is None:
        args["model"] = c.models.list().data[0].id
    return c.completions.with_raw_response.create(**args)


def _seconds(duration: str) -> float:
    """OpenAI's reset durations: 20ms, 1.5s, 6m0s."""
    if duration.endswith("ms"):
        return float(duration[:-2]) / 1000
    m = re.fullmatch(r"(?:(\d+)m)?([\d.]+)s", duration)
    assert m, duration
    return int(m.group(1) or 0) * 60 + float(m.group(2))


# ----- keys -----

def test_wrong_missing_and_accepted_keys(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "sk-wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Basic sk-vip"}, timeout=30).status_code \
        == 401
    for key in ("sk-plain", "sk-vip", "sk-other"):  # --api-key, a hashed key, a plain key
        raw = complete_raw(client(server, key))
        assert raw.parse().choices[0].text
        assert "x-ratelimit-limit-requests" not in raw.headers  # unlimited keys carry no limit headers


# ----- rate limits -----

def test_ratelimit_headers_count_down_and_tokens_settle(server):
    c = client(server, "sk-counted")
    start = time.monotonic()
    seen = []
    for _ in range(3):
        raw = complete_raw(c, max_tokens=4)
        seen.append((raw.headers, raw.parse().usage))
    elapsed = time.monotonic() - start
    for i, (headers, usage) in enumerate(seen):
        assert headers["x-ratelimit-limit-requests"] == "6"
        assert headers["x-ratelimit-remaining-requests"] == str(5 - i)  # refill is 0.1/s: no whole token back
        assert 0 < _seconds(headers["x-ratelimit-reset-requests"]) <= 10 * (i + 1) + 0.01
        assert headers["x-ratelimit-limit-tokens"] == "600"
        assert usage.completion_tokens == 4
        charged = (i + 1) * usage.total_tokens  # prompt + max_tokens, all of it generated
        remaining = int(headers["x-ratelimit-remaining-tokens"])
        assert 600 - charged <= remaining <= 600 - charged + 10 * elapsed + 1  # tokens refill at 10/s
    # A request that stops after one token is charged what it used, not its max_tokens reservation.
    before = time.monotonic()
    early = complete_raw(c, max_tokens=200, extra_body={"stop_token_ids": list(range(VOCAB))}).parse()
    after = complete_raw(c, max_tokens=4)
    refill = 10 * (time.monotonic() - before)
    expected = int(seen[-1][0]["x-ratelimit-remaining-tokens"]) - early.usage.total_tokens \
        - after.parse().usage.total_tokens
    assert early.usage.completion_tokens < 200
    assert expected <= int(after.headers["x-ratelimit-remaining-tokens"]) <= expected + refill + 10 * elapsed + 1


def test_429_with_headers_then_the_clients_own_retry_succeeds(server):
    c = client(server, "sk-burst")
    complete_raw(c)
    with pytest.raises(openai.RateLimitError) as e:
        complete_raw(c)
    response = e.value.response
    assert response.status_code == 429
    assert e.value.body["code"] == "rate_limit_exceeded" and e.value.body["type"] == "rate_limit_error"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["Retry-After"] == "1" and 0 < int(response.headers["retry-after-ms"]) <= 500
    retrying = client(server, "sk-burst", max_retries=3)
    start = time.monotonic()
    raw = complete_raw(retrying)  # the openai client waits retry-after-ms and tries again
    assert raw.parse().choices[0].text and raw.retries_taken >= 1
    assert time.monotonic() - start >= 0.2


def test_a_limited_keys_traffic_does_not_slow_an_unlimited_key(server):
    vip, limited = client(server, "sk-vip"), client(server, "sk-limited")
    model = vip.models.list().data[0].id

    def ttft(c: openai.OpenAI) -> tuple[float, list[float]]:
        start, times = time.monotonic(), []
        for _ in c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}):
            times.append(time.monotonic() - start)
        return times[0], [b - a for a, b in zip(times, times[1:], strict=False)]

    ttft(vip)  # compiles the step shapes a lone request uses (the test engine does not warm up)
    baseline = sorted(ttft(vip)[0] for _ in range(3))[1]
    stop, codes = threading.Event(), []

    def flood() -> None:  # the limited key keeps one long request running and hammers the server beside it
        while not stop.is_set():
            try:
                for _ in limited.completions.create(model=model, prompt=PROMPT, max_tokens=64, stream=True,
                                                    extra_body={"ignore_eos": True}):
                    if stop.is_set():
                        break
                codes.append(200)
            except openai.RateLimitError as e:
                codes.append(e.status_code)
                time.sleep(0.02)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: 429 in codes, 30)
        ttft(vip)  # compiles the shapes of a two-sequence batch
        runs = sorted(ttft(vip) for _ in range(3))
        loaded, gaps = runs[1]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    step = sorted(gaps)[len(gaps) // 2]
    # About one step more than alone (the limited key holds one seat), plus the noise of a shared CPU runner.
    assert loaded <= baseline + 2 * step + 0.1, (loaded, baseline, step)
    values = metric_values(server.url)
    assert values['jserve:api_key_requests_total'] >= 1  # labelled per key id; the secret never appears
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'key_id="limited",model_name=' in text or 'key_id="limited"' in text
    assert "sk-limited" not in text and 'outcome="rate_limited"' in text


def test_prefix_cache_salted_by_key(server):
    prompt = "Every tenant gets its own prefix cache. " * 6
    outs = {}
    for name, key in (("vip", "sk-vip"), ("other", "sk-other"), ("vip2", "sk-vip")):
        outs[name] = complete_raw(client(server, key), prompt=prompt).parse()
    cached = {k: (v.usage.prompt_tokens_details.cached_tokens if v.usage.prompt_tokens_details else 0)
              for k, v in outs.items()}
    assert cached["vip"] == 0 and cached["other"] == 0 and cached["vip2"] > 0
    assert len({v.choices[0].text for v in outs.values()}) == 1


def test_token_bucket_settles_with_a_fake_clock():
    now = [0.0]
    [key] = parse_api_keys({"keys": [{"id": "k", "key": "s", "tokens_per_minute": 60, "requests_per_minute": 60}]})
    limits = Limits([key], clock=lambda: now[0])
    admission = limits.begin(key, 0, 1, 4, None)
    admission.reserve_tokens([10], 40, 1, 512)
    assert limits.headers(key)["x-ratelimit-remaining-tokens"] == "10"
    admission.end(15)
    assert limits.headers(key)["x-ratelimit-remaining-tokens"] == "45"
    second = limits.begin(key, 0, 1, 4, None)
    with pytest.raises(APIError) as e:
        second.reserve_tokens([50], 10, 1, 512)
    assert e.value.status == 429 and e.value.headers["retry-after-ms"] == "15000"  # 15 tokens at 1/s
    second.refuse()
    assert limits.headers(key)["x-ratelimit-remaining-requests"] == "59"  # the refused one was given back
    now[0] += 15
    assert limits.headers(key)["x-ratelimit-remaining-tokens"] == "60"


# ----- the keys file -----

@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    ('{"keys": []}', "'keys' is empty"),
    ('{"keys": [{"key": "s"}]}', "keys[0]: 'id' must be"),
    ('{"keys": [{"id": "a", "key": "s"}, {"id": "a", "key": "t"}]}', "keys[1]: id 'a' is already used by keys[0]"),
    ('{"keys": [{"id": "a", "key": "s"}, {"id": "b", "key": "s"}]}', "keys[1] (id 'b') has the same secret"),
    ('{"keys": [{"id": "a", "key": "s", "key_sha256": "00"}]}', "give exactly one of 'key'"),
    ('{"keys": [{"id": "a", "key_sha256": "xyz"}]}', "'key_sha256' must be 64 hex digits"),
    ('{"keys": [{"id": "a", "key": "s", "requests_per_minute": 0}]}', "'requests_per_minute' must be a positive"),
    ('{"keys": [{"id": "a", "key": "s", "tokens_per_minute": "10"}]}', "'tokens_per_minute' must be a positive"),
    ('{"keys": [{"id": "a", "key": "s", "priority": 1.5}]}', "'priority' must be an integer"),
    ('{"keys": [{"id": "a", "key": "s", "rpm": 5}]}', "unknown field(s) rpm"),
    ('{"keys": [{"id": "a", "key": "s", "requests_burst": 5}]}', "'requests_burst' needs 'requests_per_minute'"),
    ('{"keys": [{"id": "default", "key": "s"}]}', None),
])
def test_keys_file_errors_name_the_entry(tmp_path, content, message):
    path = _write(tmp_path, "keys.json", content)
    if message is None:
        assert [k.id for k in load_api_keys(path)] == ["default"]
        return
    with pytest.raises(ApiKeysFileError) as e:
        load_api_keys(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_toml_keys_file_and_missing_file(tmp_path):
    path = _write(tmp_path, "keys.toml", '[[keys]]\nid = "t"\nkey = "sk-t"\nrequests_per_minute = 5\npriority = 2\n')
    [key] = load_api_keys(path)
    assert (key.id, key.requests_per_minute, key.priority) == ("t", 5, 2)
    with pytest.raises(ApiKeysFileError, match="not valid TOML"):
        load_api_keys(_write(tmp_path, "bad.toml", "[[keys]\n"))
    with pytest.raises(ApiKeysFileError, match="cannot read"):
        load_api_keys(tmp_path / "missing.json")


def test_serve_refuses_a_bad_keys_file_at_start_up(tmp_path, model_dir, capsys):
    path = _write(tmp_path, "keys.json", '{"keys": [{"id": "a b", "key": "s"}]}')
    assert jserve_main(["serve", "--model", str(model_dir), "--api-keys-file", str(path)]) == 2
    assert "keys[0]: 'id' must be" in capsys.readouterr().err
    # --api-key takes the id 'default'
    path = _write(tmp_path, "default.json", '{"keys": [{"id": "default", "key": "s"}]}')
    assert jserve_main(["serve", "--model", str(model_dir), "--api-keys-file", str(path), "--api-key", "x"]) == 2
    assert "id 'default'" in capsys.readouterr().err


# ----- deadlines -----

def test_request_timeout_aborts_and_errors(server):
    c = client(server, "sk-vip")
    model = c.models.list().data[0].id
    # 4 x 480 tokens one step at a time: far longer than the 0.1 s allowed (a step takes ~1-4 ms here)
    long = dict(model=model, prompt=PROMPT, max_tokens=480, n=4, temperature=0, extra_body={"ignore_eos": True})
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(**long, extra_headers={"X-Request-Timeout": "0.1"})
    assert e.value.status_code == 504 and e.value.body["code"] == "request_timeout"
    assert time.monotonic() - start < 5
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      headers={"Authorization": "Bearer sk-vip", "X-Request-Timeout": "0.1"},
                      json={**{k: v for k, v in long.items() if k != "extra_body"}, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert wait_until(lambda: metric_values(server.url)["jserve:num_requests_running"] == 0, 10)
    assert metric_values(server.url)["jserve:request_timeouts_total"] >= 2
    bad = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer sk-vip",
                                                              "X-Request-Timeout": "soon"},
                     json={"prompt": "hi"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"


# ----- load shedding -----

@pytest.fixture(scope="module")
def shedding_server(model_dir, tmp_path_factory):
    keys = [{"id": "low", "key": "sk-low", "priority": 10}, {"id": "high", "key": "sk-high", "priority": 0}]
    path = _write(tmp_path_factory.mktemp("shed"), "keys.json", json.dumps({"keys": keys}))
    config = EngineConfig(model=str(model_dir), **{**TEST_ENGINE_ARGS, "max_num_seqs": 2, "decode_burst": 1})
    srv = ServerThread(config, ServerSettings(api_keys_file=str(path), max_queue_delay=1.0)).start()
    yield srv
    srv.stop()


def test_queue_delay_sheds_the_lowest_tier_first(shedding_server):
    url = shedding_server.url
    low, high = client(shedding_server, "sk-low"), client(shedding_server, "sk-high")
    model = low.models.list().data[0].id
    for _ in range(8):  # a drain rate to estimate from
        low.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    streams, shed = [], None
    try:
        for _ in range(60):  # long low-tier requests fill both seats, then the queue, until one is refused
            try:
                stream = low.completions.create(model=model, prompt=PROMPT, max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                shed = e
                break
            streams.append(stream)
        assert shed is not None and shed.status_code == 503, "no request was shed"
        assert shed.body["code"] == "queue_delay_exceeded"
        assert int(shed.response.headers["Retry-After"]) >= 1
        assert len(streams) >= 2
        values = metric_values(url)
        assert values["jserve:requests_shed_total"] == 1 and values["jserve:estimated_queue_wait_seconds"] > 0.5
        # The better tier sees only its own queue: it is admitted while the low tier is refused.
        result = high.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert result.choices[0].finish_reason == "length"
    finally:
        for stream in streams:
            stream.close()
    assert wait_until(lambda: metric_values(url)["jserve:num_requests_running"] == 0, 20)
