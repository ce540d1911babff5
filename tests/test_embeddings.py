"""Embeddings (runner "pooling"): LLM.embed and /v1/embeddings against transformers' own hidden states, pooled as
sentence-transformers pools them, through the official `openai` client."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from hf_models import _save_random, make_config, save_tokenizer

import cpu_kernels
from jserve import PoolingParams, SamplingParams
from jserve.engine.pooling import checkpoint_pooling_type
from jserve.sampling_params import InvalidParameterError

# lengths around the step's 32-token budget: the 50- and 33-token prompts are pooled over chunks
PROMPTS = [list(range(5, 5 + n)) for n in (7, 50, 1, 33)]
EXECUTORS = ["xla", "cpu-layers"] if cpu_kernels.available() else ["xla"]


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """A tiny Qwen3 saved as transformers' AutoModel saves an embedding model (Qwen3-Embedding): Qwen3Model, no LM
    head, its tensors named without "model."."""
    out = tmp_path_factory.mktemp("qwen3_embedding")
    torch.manual_seed(0)
    _save_random(transformers.Qwen3Model(make_config("qwen3")), out)
    save_tokenizer(out)
    return out


def hf_pooled(model_dir, prompt: list[int], pooling: str) -> np.ndarray:
    """transformers' last hidden state (after the final norm) pooled as sentence-transformers' Pooling module does."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0].numpy()
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]


def _embed_llm(llm_factory, model_dir, **settings):
    return llm_factory(model_dir, runner="pooling", max_num_batched_tokens=32, **settings)


# Every pooling on the XLA executor; the CPU layer executor's own output path (the hidden rows it returns) under
# LAST and MEAN, which read one row a sequence and every row.
@pytest.mark.parametrize(("executor", "pooling"), [("xla", "LAST"), ("xla", "MEAN"), ("xla", "CLS"),
                                                   *(("cpu-layers", p) for p in ("LAST", "MEAN")
                                                     if "cpu-layers" in EXECUTORS)])
def test_embeddings_match_transformers(base_model_dir, llm_factory, executor, pooling):
    llm = _embed_llm(llm_factory, base_model_dir, executor=executor, pooling_type=pooling)
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = hf_pooled(base_model_dir, prompt, pooling)
        assert out.prompt_token_ids == prompt and out.finished
        np.testing.assert_allclose(out.outputs.embedding, expected / np.linalg.norm(expected), atol=2e-6)
    raw, short = llm.embed({"prompt_token_ids": PROMPTS[1]}, [PoolingParams(normalize=False)], use_tqdm=False)[0], \
        llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = hf_pooled(base_model_dir, PROMPTS[1], pooling)
    np.testing.assert_allclose(raw.outputs.embedding, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(short.outputs.embedding, expected[:16] / np.linalg.norm(expected[:16]), atol=2e-6)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_llm_score_is_the_cosine_of_the_embeddings(base_model_dir, llm_factory):
    llm = _embed_llm(llm_factory, base_model_dir, executor="xla", pooling_type="MEAN")
    unit = [v / np.linalg.norm(v) for v in (hf_pooled(base_model_dir, p, "MEAN") for p in PROMPTS)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one = llm.score(prompts[0], prompts[1:], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in one], [unit[0] @ u for u in unit[1:]], atol=1e-5)
    assert [o.prompt_token_ids for o in one] == PROMPTS[1:]
    pairs = llm.score(prompts[:2], prompts[2:], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in pairs], [unit[0] @ unit[2], unit[1] @ unit[3]], atol=1e-5)
    with pytest.raises(ValueError, match="give data_1 one prompt"):
        llm.score(prompts[:2], prompts[1:], use_tqdm=False)


def test_embedding_engine_compiles_nothing_after_warmup(base_model_dir):
    """MEAN pooling takes a row a token: warm-up compiles those steps, and chunked prompts of every length compile
    nothing new."""
    import jax
    from jax._src import dispatch

    from jserve import LLM

    llm = LLM(str(base_model_dir), runner="pooling", pooling_type="MEAN", executor="xla", max_model_len=256,
              kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=64, max_num_seqs=4, compilation_cache_dir="")
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT else None)
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(1, 256, 12)]
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        jax.monitoring.clear_event_listeners()
    assert compiles == [] and len(outputs) == 12 and llm.engine.stats.warmup_step_shapes > 0
    assert all(abs(np.linalg.norm(o.outputs.embedding) - 1) < 1e-5 for o in outputs)


def test_pooling_type_comes_from_the_sentence_transformers_config(base_model_dir, tmp_path):
    assert checkpoint_pooling_type(base_model_dir) == "LAST"  # no modules.json
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    flags = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
             "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    assert checkpoint_pooling_type(tmp_path) == "MEAN"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({**flags, "pooling_mode_mean_tokens": False,
                                                                    "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*is not supported"):
        checkpoint_pooling_type(tmp_path)


def test_embedding_errors(base_model_dir, hf_model_dir, llm_factory):
    from jserve import LLM

    llm = _embed_llm(llm_factory, base_model_dir, executor="xla", pooling_type="LAST")
    with pytest.raises(ValueError, match="serves embeddings"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="dimensions 65 exceeds the model's embedding size 64"):
        llm.embed({"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="maximum context length"):
        llm.embed({"prompt_token_ids": [5] * 513}, use_tqdm=False)
    assert len(llm.embed({"prompt_token_ids": [5] * 512}, use_tqdm=False)[0].outputs.embedding) == 64
    assert not llm.engine.has_unfinished_requests()
    generator = llm_factory(hf_model_dir("llama"))
    with pytest.raises(ValueError, match="runner 'pooling'"):
        generator.embed(["hello"], use_tqdm=False)
    for bad, match in [(dict(pooling_type="max"), "pooling_type must be one of"),
                       (dict(runner="embed"), "runner must be one of"),
                       (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                        "speculative_config and enable_lora do not apply")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(base_model_dir), **{"runner": "pooling", **bad})
    with pytest.raises(ValueError, match="normalize must be true or false"):
        PoolingParams(normalize="yes")


@pytest.fixture(scope="module")
def embedding_server(base_model_dir):
    from server_helpers import TEST_ENGINE_ARGS, ServerThread

    from jserve.config import EngineConfig
    from jserve.server.settings import ServerSettings

    config = EngineConfig(model=str(base_model_dir), runner="pooling", executor="xla", **TEST_ENGINE_ARGS)
    srv = ServerThread(config, ServerSettings()).start()
    yield srv
    srv.stop()


def test_embeddings_through_the_openai_client(embedding_server, base_model_dir):
    """The official client's default (base64, decoded by the client), floats, token ids and dimensions: each the
    transformers hidden state of the tokens the model's own tokenizer makes."""
    import openai

    client = openai.OpenAI(base_url=f"{embedding_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = embedding_server.state.model_name
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_model_dir)
    texts = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog."]
    expected = [hf_pooled(base_model_dir, tokenizer(t)["input_ids"], "LAST") for t in texts]
    for fmt in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model=model, input=texts, encoding_format=fmt)
        assert [d.index for d in response.data] == [0, 1] and response.model == model
        assert response.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
        for got, want in zip(response.data, expected, strict=True):
            np.testing.assert_allclose(got.embedding, want / np.linalg.norm(want), atol=2e-6)
    short = client.embeddings.create(model=model, input=PROMPTS[1], dimensions=8, encoding_format="float")
    want = hf_pooled(base_model_dir, PROMPTS[1], "LAST")[:8]
    np.testing.assert_allclose(short.data[0].embedding, want / np.linalg.norm(want), atol=2e-6)
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client.completions.create(model=model, prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="dimensions 65 exceeds"):
        client.embeddings.create(model=model, input="hello", dimensions=65)
    with pytest.raises(openai.BadRequestError, match="encoding_format"):
        client.embeddings.create(model=model, input="hello", encoding_format="int8")


def test_score_and_rerank_are_cosine_similarities(embedding_server, base_model_dir):
    """vLLM's /score (one text against several, and pairwise) and /rerank (Jina's and Cohere's shape): each score is
    the cosine similarity of transformers' embeddings of the two texts."""
    import httpx

    tokenizer = transformers.AutoTokenizer.from_pretrained(base_model_dir)
    texts = ["what is jax?", "JAX is a Python library", "a recipe for soup", "def f(x): return x"]
    unit = {}
    for text in texts:
        v = hf_pooled(base_model_dir, tokenizer(text)["input_ids"], "LAST")
        unit[text] = v / np.linalg.norm(v)
    url = embedding_server.url
    one = httpx.post(f"{url}/score", json={"text_1": texts[0], "text_2": texts[1:]}, timeout=60).json()
    assert [d["index"] for d in one["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in one["data"]], [unit[texts[0]] @ unit[t] for t in texts[1:]],
                               atol=1e-5)
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": texts[:2], "text_2": texts[2:]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [unit[texts[0]] @ unit[texts[2]],
                                                                     unit[texts[1]] @ unit[texts[3]]], atol=1e-5)
    ranked = httpx.post(f"{url}/v1/rerank", json={"query": texts[0], "top_n": 2, "documents": [
        texts[1], {"text": texts[2]}, texts[3]]}, timeout=60).json()["results"]
    expected = sorted(range(3), key=lambda i: -(unit[texts[0]] @ unit[texts[i + 1]]))[:2]
    assert [r["index"] for r in ranked] == expected
    assert [r["document"]["text"] for r in ranked] == [texts[i + 1] for i in expected]
    np.testing.assert_allclose([r["relevance_score"] for r in ranked],
                               [unit[texts[0]] @ unit[texts[i + 1]] for i in expected], atol=1e-5)
    bare = httpx.post(f"{url}/rerank", json={"query": "q", "documents": ["a"], "return_documents": False},
                      timeout=60).json()["results"]
    assert "document" not in bare[0]
    for body, message in [({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "give text_1 one text"),
                          ({"text_1": "a", "text_2": []}, "text_2 must be")]:
        response = httpx.post(f"{url}/score", json=body, timeout=60)
        assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_a_text_model_refuses_embeddings():
    import httpx
    from server_helpers import TEST_ENGINE_ARGS, ServerThread

    from checkpoints import DEMO_MODEL_DIR
    from jserve.config import EngineConfig
    from jserve.server.settings import ServerSettings

    srv = ServerThread(EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS), ServerSettings()).start()
    try:
        response = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "hello"}, timeout=60)
        reranked = httpx.post(f"{srv.url}/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
    finally:
        srv.stop()
    for refused in (response, reranked):
        assert refused.status_code == 400
        assert "does not serve embeddings" in refused.json()["error"]["message"]


def test_a_batch_job_writes_embeddings(base_model_dir, tmp_path):
    """`jserve generate` with an embedding model: each line's vector, as transformers' hidden state pools; a line
    with a generation field is skipped with its reason."""
    from jserve.batch import run_batch
    from jserve.config import EngineConfig

    lines = [{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[1], "dimensions": 8},
             {"id": "c", "prompt": PROMPTS[2], "max_tokens": 3}]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = EngineConfig(model=str(base_model_dir), runner="pooling", executor="xla", max_model_len=256,
                          kv_cache_memory_bytes=1 << 20, warmup=False, compilation_cache_dir="")
    assert run_batch(config, source, results) == 0
    records = {r["id"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert set(records) == {"a", "b"}
    for key, prompt, width in (("a", PROMPTS[0], None), ("b", PROMPTS[1], 8)):
        want = hf_pooled(base_model_dir, prompt, "LAST")[:width]
        np.testing.assert_allclose(records[key]["embedding"], want / np.linalg.norm(want), atol=2e-6)
        assert records[key]["usage"]["prompt_tokens"] == len(prompt)
