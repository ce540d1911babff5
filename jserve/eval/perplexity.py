"""`jserve eval perplexity`: a model's perplexity on a text, computed the way llama.cpp's `llama-perplexity`
computes it (tools/perplexity/perplexity.cpp), so the two tools' figures compare.

The scheme, with N the text's tokens and C = --context (llama-perplexity's -c):

1. **Tokens.** The whole text is tokenized once, with the BOS token first where the model's tokenizer puts one
   before a text (llama.cpp: `common_tokenize(ctx, text, add_special=true)`; no EOS). A file's one trailing newline
   is dropped first, as llama.cpp's `-f` drops it. The text must give at least 2 * C tokens (llama.cpp's minimum).
2. **Default scheme** (`--stride 0`; llama-perplexity without `--ppl-stride`). The tokens are cut into N // C
   consecutive chunks of C tokens; what is left after the last whole chunk is not read. Each chunk is one window,
   from position 0, whose first token is replaced by BOS where the model uses one (the first chunk already starts
   with it). Only the second half of each window is scored: the tokens at positions C/2 + 1 .. C - 1 (integer
   C/2), each given every token before it in its window, C - C/2 - 1 tokens a window (255 at C = 512). So about
   half the text is scored, each token with C/2 + 1 to C - 1 tokens of context, and the windows are independent.
3. **Strided scheme** (`--stride S`, 0 < S < C; llama-perplexity's `--ppl-stride S`, its `perplexity_v2`).
   Windows of C tokens start every S tokens (0, S, 2S, ...: ceil((N - C) / S) windows), each scoring its last S
   tokens, so every token from position C - S of the text until the last window's end is scored once, given at
   least C - S tokens before it. These windows hold the text's tokens as they are: llama.cpp's strided pass writes
   BOS into its token array only after the window was evaluated, so the model never reads it there (the first
   window starts with the tokenizer's own BOS). llama-perplexity's strided window is its whole context, which it
   enlarges by S/2 and the library rounds up to a multiple of 256: `-c 512 -b 512 --ppl-stride 256` reads windows
   of 768 tokens, the same as `--context 768 --stride 256` here.

`--chunks K` scores only the first K windows (llama-perplexity's --chunks). Perplexity is exp(mean negative
log-likelihood) over the scored tokens; the ± is llama.cpp's (it prints it in the default scheme): the perplexity
times the standard error of the mean NLL, sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).

Every window is one request of the same batch: its tokens but the last as the prompt, with `prompt_logprobs=0`
(the smallest top-k, whose entry at each position still holds the logprob of the prompt's own next token), and
the window's last token as the one generated token, forced by a logit bias, with `logprobs=0`: the logprob
returned is the raw one (vLLM's order: before the bias), so it is that token's logprob given the rest of the
window. A window of C tokens then needs a max_model_len of C, not C + 1, as llama.cpp evaluates C tokens and reads
the logits of the first C - 1: a window as long as the model's context (`--context` = max_position_embeddings)
fits. Positions a window does not score are computed anyway (they are its context).

Where the two tools' tokenizers agree, the same tokens are scored with the same context; they can differ where the
text holds a special token's spelling (llama.cpp reads it as plain text, Hugging Face tokenizers as the special
token) or where a GGUF's `add_bos_token` and the Hugging Face tokenizer disagree (`--add-bos/--no-add-bos` then
sets it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from argparse import Namespace
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jserve.sampling_params import SamplingParams

PROBE_TEXT = "Hello world"  # what tokenizer_bos_id encodes to see whether the tokenizer puts a BOS first


@dataclass(frozen=True)
class Window:
    """One request: `tokens` read from position 0, the ones from `first_scored` on scored (each given those before
    it). `start`: where tokens[0] lies in the text's tokens."""

    start: int
    tokens: list[int]
    first_scored: int

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.first_scored


def read_text(path: str | Path) -> str:
    """The file's text as llama.cpp's `-f` reads it: every byte as it is (no newline translation), one trailing
    newline dropped."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:  # its own message names the codec and byte, not the file
        raise ValueError(f"--text {path}: not UTF-8 text ({e})") from None
    return text[:-1] if text.endswith("\n") else text


def tokenizer_bos_id(tokenizer) -> int | None:
    """The token the tokenizer puts before every text (its BOS), or None where it puts none."""
    plain = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    special = tokenizer.encode(PROBE_TEXT, add_special_tokens=True)
    if len(special) == len(plain) + 1 and special[1:] == plain:
        return special[0]
    return None


def tokenize_text(tokenizer, text: str, add_bos: bool | None = None) -> tuple[list[int], int | None]:
    """The text's tokens as llama-perplexity takes them, and the BOS id (None: the model uses none). add_bos None
    follows the tokenizer; True or False overrides it (True needs a tokenizer that names a BOS token)."""
    bos = tokenizer_bos_id(tokenizer)
    if add_bos is False:
        bos = None
    elif add_bos and bos is None:
        bos = getattr(getattr(tokenizer, "hf", None), "bos_token_id", None)
        if bos is None:
            raise ValueError("--add-bos: the tokenizer names no BOS token")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([bos] if bos is not None else []) + list(ids), bos


def check_stride(context: int, stride: int) -> None:
    if not 0 <= stride < context:
        raise ValueError(f"--stride must be 0 (llama-perplexity's default scheme) or in [1, --context - 1] = "
                         f"[1, {context - 1}], got {stride}")


def llama_perplexity_windows(tokens: Sequence[int], context: int, stride: int = 0, bos_id: int | None = None,
                             max_chunks: int | None = None) -> list[Window]:
    """llama-perplexity's windows over the text's tokens (BOS already first where the model uses one): stride 0 is
    its default scheme, stride S its `--ppl-stride S` (see the module's docstring)."""
    n = len(tokens)
    if context < 3:
        raise ValueError(f"--context must be at least 3 to score any token, got {context}")
    if n < 2 * context:
        raise ValueError(f"the text gives {n} tokens; a context of {context} needs at least {2 * context} "
                         f"(llama-perplexity's minimum)")
    if stride == 0:
        count = n // context
        first = context // 2 + 1
        windows = []
        for i in range(count if max_chunks is None else min(count, max_chunks)):
            chunk = list(tokens[i * context:(i + 1) * context])
            if bos_id is not None:
                chunk[0] = bos_id
            windows.append(Window(i * context, chunk, first))
        return windows
    check_stride(context, stride)
    count = (n - context + stride - 1) // stride
    if max_chunks is not None:
        count = min(count, max_chunks)
    return [Window(i * stride, list(tokens[i * stride:i * stride + context]), context - stride)
            for i in range(count)]


# The logit bias that makes a window's last token the one generated (the largest SamplingParams allows): any token
# whose logprob is above -FORCE_BIAS wins the argmax with it.
FORCE_BIAS = 100.0


def score_windows(llm, windows: Sequence[Window], use_tqdm: bool = False) -> np.ndarray:
    """The negative log-likelihood of every scored token, window by window, from one batch of requests: the window
    but its last token as the prompt, the last token generated (forced; see the module's docstring)."""
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=0, ignore_eos=True,
                             logit_bias={w.tokens[-1]: FORCE_BIAS}) for w in windows]
    outputs = llm.generate([{"prompt_token_ids": w.tokens[:-1]} for w in windows], params, use_tqdm=use_tqdm)
    nll = []
    for window, out in zip(windows, outputs, strict=True):
        for position in range(window.first_scored, len(window.tokens) - 1):
            nll.append(-out.prompt_logprobs[position][window.tokens[position]])
        last, sample = window.tokens[-1], out.outputs[0]
        if list(sample.token_ids) != [last]:
            raise ValueError(f"the window at token {window.start}: its last token {last} has a logprob below "
                             f"-{FORCE_BIAS:g}, or the logits are not numbers (a logit bias of {FORCE_BIAS:g} did not "
                             "make it the argmax)")
        nll.append(-sample.logprobs[0][last])
    return np.asarray(nll, dtype=np.float64)


def perplexity_of(nll: np.ndarray) -> tuple[float, float | None]:
    """(perplexity, its ± as llama-perplexity prints it; None where it has none: one token, or no spread)."""
    count = len(nll)
    mean = float(np.mean(nll))
    ppl = math.exp(mean)
    variance = float(np.mean(nll * nll)) - mean * mean
    if count < 2 or not variance > 0:
        return ppl, None
    return ppl, ppl * math.sqrt(variance / (count - 1))


def evaluate(llm, text: str, context: int = 512, stride: int = 0, add_bos: bool | None = None,
             max_chunks: int | None = None, use_tqdm: bool = False) -> dict:
    """Perplexity of the LLM's model on the text (llama-perplexity's scheme), with what was scored and how fast."""
    tokens, bos = tokenize_text(llm.get_tokenizer(), text, add_bos)
    windows = llama_perplexity_windows(tokens, context, stride, bos, max_chunks)
    start = time.perf_counter()
    nll = score_windows(llm, windows, use_tqdm)
    elapsed = time.perf_counter() - start
    ppl, error = perplexity_of(nll)
    processed = sum(len(w.tokens) for w in windows)
    return {"perplexity": ppl, "perplexity_error": error, "mean_nll": float(np.mean(nll)),
            "scheme": "default" if stride == 0 else "strided", "context": context, "stride": stride,
            "bos_token_id": bos, "num_text_tokens": len(tokens), "num_windows": len(windows),
            "num_processed_tokens": processed, "num_scored_tokens": len(nll), "elapsed_s": elapsed,
            "tokens_per_s": processed / elapsed, "scored_tokens_per_s": len(nll) / elapsed}


def run_perplexity(args: Namespace) -> int:
    from jserve.engine_args import engine_config_from_args
    from jserve.llm import LLM

    check_stride(args.context, args.stride)  # before the model loads
    text = read_text(args.text)
    config = engine_config_from_args(args)
    if config.max_model_len is None:  # a window: its last token is the one each request generates
        config = config.replace(max_model_len=args.context)
    llm = LLM(**dataclasses.asdict(config))
    result = evaluate(llm, text, args.context, args.stride, args.add_bos, args.chunks,
                      use_tqdm=not args.disable_tqdm)
    report = {"model": args.model, "text": str(args.text), "text_bytes": len(text.encode("utf-8")),
              "dtype": args.dtype, **result}
    print(summary(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def summary(report: dict) -> str:
    error = report["perplexity_error"]
    estimate = f"PPL = {report['perplexity']:.4f}" + ("" if error is None else f" +/- {error:.5f}")
    context, stride = report["context"], report["stride"]
    scheme = (f"llama-perplexity's default scheme: {report['num_windows']} windows of {context} tokens, the last "
              f"{context - context // 2 - 1} of each scored" if stride == 0 else
              f"llama-perplexity's strided scheme: {report['num_windows']} windows of {context} tokens every {stride}, "
              f"the last {stride} of each scored")
    bos = "no BOS" if report["bos_token_id"] is None else f"BOS {report['bos_token_id']} first"
    return (f"Final estimate: {estimate}\n"
            f"Scored {report['num_scored_tokens']} of the text's {report['num_text_tokens']} tokens ({scheme}; "
            f"{bos})\n"
            f"Speed: {report['num_processed_tokens']} tokens in {report['elapsed_s']:.2f} s = "
            f"{report['tokens_per_s']:.1f} tokens/s ({report['scored_tokens_per_s']:.1f} scored tokens/s; "
            f"compiles on first use included)")
