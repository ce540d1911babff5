"""Scoring and reranking (vLLM's /score and /rerank, the latter Jina's and Cohere's shape) on an embedding model:
a pair's score is the cosine similarity of the two texts' embeddings, as vLLM scores with an embedding model (jserve
serves no cross-encoder). Every text of a request is embedded in one batch (jserve.engine.pooling)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jserve.pooling_params import PoolingParams
from jserve.server import responses as R
from jserve.server import routes
from jserve.server.http import read_json
from jserve.server.protocol import EmbeddingRequest, bad_request
from jserve.server.state import ServerState


def _texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad_request(f"{name} must be a non-empty string or a non-empty list of them", name)
    return texts


def _truncate(body: dict) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise bad_request("truncate_prompt_tokens must be a positive integer", "truncate_prompt_tokens")
    return value


async def _similarities(request: Request, state: ServerState, body: dict, firsts: list[str], seconds: list[str]
                        ) -> tuple[str, list[float], int] | Response:
    """The cosine similarity of each (firsts[i], seconds[i]) pair (a single first pairs with every second)."""
    unique = list(dict.fromkeys(firsts + seconds))
    params = PoolingParams(truncate_prompt_tokens=_truncate(body))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    result = await routes.embed(request, state, EmbeddingRequest(model, unique, params, "float", 0))
    if isinstance(result, Response):  # the client went away
        return result
    name, vectors, tokens = result
    by_text = {text: np.asarray(v, np.float64) for text, v in zip(unique, vectors, strict=True)}
    pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True)
    return name, [float(by_text[a] @ by_text[b]) for a, b in pairs], tokens


async def score(request: Request, state: ServerState) -> Response:
    """{"model", "text_1", "text_2"}: one score a pair (text_1 a string or as many texts as text_2)."""
    body = await read_json(request, state.settings.max_request_bytes)
    firsts, seconds = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise bad_request(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give text_1 one text, or as "
                          "many as text_2", "text_1")
    result = await _similarities(request, state, body, firsts, seconds)
    if isinstance(result, Response):
        return result
    name, scores, tokens = result
    return JSONResponse({"id": R.new_id("score"), "object": "list", "created": int(time.time()), "model": name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: Request, state: ServerState) -> Response:
    """{"model", "query", "documents", "top_n", "return_documents"}: the documents by relevance to the query, the
    most relevant first (Jina's and Cohere's rerank; a document may be a string or {"text": ...})."""
    body = await read_json(request, state.settings.max_request_bytes)
    query = _texts(body.get("query"), "query")
    if len(query) != 1:
        raise bad_request("query must be one string", "query")
    documents = body.get("documents")
    if isinstance(documents, list):
        documents = [d.get("text") if isinstance(d, dict) else d for d in documents]
    documents = _texts(documents, "documents")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise bad_request("top_n must be a positive integer", "top_n")
    result = await _similarities(request, state, body, query, documents)
    if isinstance(result, Response):
        return result
    name, scores, tokens = result
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n or len(documents)]
    keep = body.get("return_documents", True) is not False
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}} if keep else {})}
               for i in order]
    return JSONResponse({"id": R.new_id("rerank"), "model": name, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


ROUTES = [(path, ["POST"], score, True) for path in ("/score", "/v1/score")] + \
    [(path, ["POST"], rerank, True) for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
