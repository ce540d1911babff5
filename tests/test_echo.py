"""Completions' echo (lm-evaluation-harness' loglikelihood requests: echo, logprobs, max_tokens 0) through the
official `openai` client: the prompt tokens' logprobs against transformers' own."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from hf_models import load_hf
from server_helpers import TEST_ENGINE_ARGS, ServerThread

from jserve.config import EngineConfig
from jserve.server.settings import ServerSettings

PROMPT = "def fibonacci(n):\n    return n"


@pytest.fixture(scope="module")
def served(hf_model_dir):
    model_dir = hf_model_dir("llama")
    srv = ServerThread(EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS), ServerSettings()).start()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield srv, client, model_dir
    srv.stop()


def _hf_prompt_logprobs(model_dir, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt token's logprob after the tokens before it, and the likeliest token's there."""
    with torch.no_grad():
        logits = load_hf(model_dir)(torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1).numpy()
    return np.array([logprobs[i - 1, ids[i]] for i in range(1, len(ids))]), logprobs[:-1].max(-1)


@pytest.mark.parametrize("prompt_kind", ["text", "token ids"])
def test_echo_scores_the_prompt(served, prompt_kind):
    srv, client, model_dir = served
    ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    prompt = PROMPT if prompt_kind == "text" else ids
    reply = client.completions.create(model=srv.state.model_name, prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=2, temperature=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == PROMPT and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    given, best = _hf_prompt_logprobs(model_dir, ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], given, atol=1e-4)
    np.testing.assert_allclose([max(top.values()) for top in lp.top_logprobs[1:]], best, atol=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:]) and lp.text_offset[0] == 0


def test_echo_before_a_completion_streamed_and_not(served):
    srv, client, _ = served
    kwargs = dict(model=srv.state.model_name, prompt=PROMPT, max_tokens=5, logprobs=1, temperature=0)
    plain = client.completions.create(**kwargs).choices[0]
    kwargs["echo"] = True
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == PROMPT + plain.text
    assert whole.logprobs.tokens[-5:] == plain.logprobs.tokens and len(whole.logprobs.tokens) == len(
        whole.logprobs.token_logprobs)
    assert whole.logprobs.token_logprobs[-5:] == plain.logprobs.token_logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens


def test_max_tokens_0_needs_echo(served):
    srv, client, _ = served
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model=srv.state.model_name, prompt=PROMPT, max_tokens=0)
