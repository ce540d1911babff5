"""The /playground page in a real headless Chromium (Debian's `chromium`, driven by playwright; no browser download)
against a live server on the demo model: a chat reply streams in and equals the engine's greedy text, a completion
with a JSON schema matches it, Stop aborts a generation (and the server frees it), a wrong API key shows the 401.

Set JSERVE_UPDATE_SCREENSHOT=1 to rewrite docs/images/playground.png from the chat test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright
from server_helpers import TEST_ENGINE_ARGS, ServerThread, wait_until

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.sampling_params import SamplingParams
from jserve.server.settings import ServerSettings

CHROMIUM = os.environ.get("JSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
NODE = shutil.which("node")


def require_chromium() -> None:
    # Every test of the live page needs the browser; the page's script alone (test_reply_stats_*) needs node only.
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install -y chromium; .ci/run installs it where "
                    "apt-get exists)")

API_KEY = "playground-key"
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "playground.png"


@pytest.fixture(scope="module")
def server():
    require_chromium()
    # decode_burst 1: a chunk per token, so streaming is visible even from this fast model.
    config = EngineConfig(model=str(DEMO_MODEL_DIR), **{**TEST_ENGINE_ARGS, "decode_burst": 1})
    srv = ServerThread(config, ServerSettings(api_key=API_KEY, served_model_name="demo")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    require_chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{server.url}/")  # redirects to /playground
    assert page.url == f"{server.url}/playground"
    yield page
    context.close()


# The page's Content-Security-Policy forbids eval, so every wait_for_function predicate here is a function (which
# playwright calls) rather than an expression (which it would eval).
def sign_in(page, key: str = API_KEY) -> None:
    page.fill("#api-key", key)
    page.dispatch_event("#api-key", "change")
    if key == API_KEY:
        page.wait_for_function("() => document.querySelector('#model').options.length > 0")


def last_reply(page):
    return page.locator(".msg.assistant").last


def wait_finished(page) -> str:
    page.wait_for_function("() => ['done', 'stopped', 'error'].includes("
                           "[...document.querySelectorAll('.msg.assistant')].pop().dataset.state)")
    return last_reply(page).get_attribute("data-state")



def test_page_is_self_contained(server):
    response = httpx.get(f"{server.url}/playground")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    html = response.text
    assert "http://" not in html and "https://" not in html  # no CDN: nothing loads from elsewhere
    assert httpx.get(f"{server.url}/").status_code == 307


def test_chat_streams_the_greedy_reply_and_keeps_the_history(page, server, llm_factory):
    sign_in(page)
    assert page.locator("#model option").all_inner_texts() == ["demo"]
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")
    # Count the reply's text updates as the browser renders them.
    page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.querySelector('#log'), {subtree: true, characterData: true, childList: true}); }""")
    page.fill("#input", "def add(a, b):")
    page.press("#input", "Enter")
    assert wait_finished(page) == "done"
    reply = last_reply(page)
    text = reply.locator(".text").inner_text()
    llm = llm_factory(DEMO_MODEL_DIR)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    expected = llm.chat([{"role": "user", "content": "def add(a, b):"}], greedy, use_tqdm=False)[0].outputs[0]
    assert text == expected.text
    assert int(reply.get_attribute("data-chunks")) > 1 and page.evaluate("window.updates") > 3
    stats = reply.locator(".stats").inner_text()
    assert "TTFT" in stats and "tok/s" in stats and f"{len(expected.token_ids)} tokens" in stats
    # The second turn is sent with the first in its history.
    page.fill("#input", "import os")
    page.click("#send")
    assert wait_finished(page) == "done"
    history = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": expected.text},
               {"role": "user", "content": "import os"}]
    second = llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    assert last_reply(page).locator(".text").inner_text() == second
    if os.environ.get("JSERVE_UPDATE_SCREENSHOT"):
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))


def test_completion_with_a_json_schema(page):
    sign_in(page)
    page.check("#mode-completion")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "30")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    page.fill("#schema", json.dumps(schema))
    page.fill("#input", "Is the sky blue? Answer in JSON:")
    page.click("#send")
    assert wait_finished(page) == "done"
    assert json.loads(last_reply(page).locator(".text").inner_text())["answer"] in ("yes", "no")
    assert "finish: stop" in last_reply(page).locator(".stats").inner_text()


def test_stop_aborts_the_generation(page, server):
    sign_in(page)
    page.fill("#max-tokens", "400")
    engine = server.state.engine.engine
    step = engine.step

    def slow_step():  # a slow model: the generation is surely still running when Stop is clicked
        time.sleep(0.03)
        return step()

    engine.step = slow_step
    try:
        page.fill("#input", "class Parser:")
        page.click("#send")
        page.wait_for_function("() => Number([...document.querySelectorAll('.msg.assistant')].pop()"
                               ".dataset.chunks) >= 3")
        assert page.is_enabled("#stop") and not page.is_enabled("#send")
        page.click("#stop")
        assert wait_finished(page) == "stopped"
        assert "finish: stopped" in last_reply(page).locator(".stats").inner_text()
        assert page.is_enabled("#send") and not page.is_enabled("#stop")
        # The closed connection aborted the request: the engine holds nothing for it.
        assert wait_until(lambda: not engine.has_unfinished_requests(), timeout=10)
    finally:
        engine.step = step


def test_a_wrong_key_shows_the_401(page):
    sign_in(page, "not-the-key")
    page.wait_for_selector("#error:not([hidden])")
    assert "401" in page.inner_text("#error")
    page.fill("#input", "hello")
    page.click("#send")
    assert wait_finished(page) == "error"
    error = page.inner_text("#error")
    assert error.startswith("401") and "API key" in error


def reply_stats(*args) -> str:
    """The page's own replyStats(start, first, last, count, unit, finish), run in node."""
    if NODE is None:
        pytest.skip("no node to run the page's script")
    from jserve.server.playground import page as playground_page

    script = playground_page().split("<script>", 1)[1].split("</script>", 1)[0]
    function = re.search(r"^function replyStats\(.*?^}$", script, flags=re.S | re.M).group(0)
    run = subprocess.run([NODE, "-e", f"{function}\nprocess.stdout.write(replyStats(...{json.dumps(args)}))"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_reply_stats_rate_is_the_tokens_after_the_first_over_their_time():
    # 11 tokens: the first 200 ms after sending, the last 1 s after the first. The rate after the first token is
    # vLLM's 1 / TPOT = (output tokens - 1) / (E2EL - TTFT) = 10 tokens/s, not 11.
    stats = reply_stats(1000, 1200, 2200, 11, "tokens", "length")
    assert stats.split(" · ") == ["TTFT 200 ms", "11 tokens", "10.0 tok/s", "finish: length"]
    # A stopped reply has no usage: its chunks, counted the same way.
    assert reply_stats(0, 50, 550, 6, "chunks", "stopped").split(" · ") == \
        ["TTFT 50 ms", "6 chunks", "10.0 chunks/s", "finish: stopped"]
    # One chunk gives no time after the first token, so no rate; no chunk at all, only the finish reason.
    assert reply_stats(0, 30, 30, 1, "tokens", "stop") == "TTFT 30 ms · 1 tokens · finish: stop"
    assert reply_stats(0, None, None, 0, "tokens", "length") == "finish: length"
