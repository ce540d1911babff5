"""From sampled tokens to RequestOutputs: incremental detokenization, stop conditions, logprobs, finishing.

The engine hands each step's tokens here; this module alone appends them to their sequences, decides which sequences
stop (EOS, stop tokens, stop strings, max_tokens, max_model_len) and builds what the caller sees. It never touches the
KV cache: the sequences it ends are returned for the scheduler to retire.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from jserve.engine.sequence import ScheduledSeq, Sequence, SequenceStatus
from jserve.outputs import CompletionOutput, Logprob, RequestOutput
from jserve.sampling_params import RequestOutputKind, SamplingParams
from jserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class SeqStream:
    """The text side of one sequence: incremental detokenization and stop-string matching."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # the sampled tokens' logprobs summed, where logprobs are asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # What earlier outputs of a DELTA request reported: characters of text, tokens, and whether it had finished.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    streams: list[SeqStream]
    arrival_time: float
    final_only: bool = False  # reported once, when it finishes (RequestOutputKind.FINAL_ONLY)
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    delta: bool = False  # each output holds only what the last one did not (RequestOutputKind.DELTA)
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all([s.seq.status is SequenceStatus.FINISHED for s in self.streams])  # read per request per step

    def output(self) -> RequestOutput:
        if self.delta:
            return self._delta_output()
        outputs = [CompletionOutput(index=s.seq.index, text=s.text, token_ids=list(s.seq.output_token_ids),
                                    finish_reason=s.seq.finish_reason, stop_reason=s.seq.stop_reason,
                                    logprobs=None if s.logprobs is None else list(s.logprobs),
                                    cumulative_logprob=s.cumulative_logprob)
                   for s in self.streams]
        return self._request_output(outputs, self.streams[0].prompt_logprobs)

    def _delta_output(self) -> RequestOutput:
        """vLLM's DELTA: each sample's text, tokens and logprobs since the request's last output (samples with none
        left out, unless they just finished), and the prompt logprobs in the first output only."""
        outputs = []
        for s in self.streams:
            tokens = s.seq.output_token_ids[s.sent_tokens:]
            text = s.text[s.sent_text:]
            finished = s.seq.finish_reason is not None
            if not (tokens or text or (finished and not s.sent_finish)):
                continue
            outputs.append(CompletionOutput(
                index=s.seq.index, text=text, token_ids=list(tokens), finish_reason=s.seq.finish_reason,
                stop_reason=s.seq.stop_reason, cumulative_logprob=s.cumulative_logprob,
                logprobs=None if s.logprobs is None else s.logprobs[s.sent_tokens:s.sent_tokens + len(tokens)]))
            s.sent_text, s.sent_tokens, s.sent_finish = len(s.text), s.sent_tokens + len(tokens), finished
        prompt_logprobs = None if self.sent_prompt_logprobs else self.streams[0].prompt_logprobs
        self.sent_prompt_logprobs = self.sent_prompt_logprobs or prompt_logprobs is not None
        return self._request_output(outputs, prompt_logprobs)

    def _request_output(self, outputs: list[CompletionOutput], prompt_logprobs) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs, finished=self.finished,
                             num_cached_tokens=self.streams[0].seq.num_cached_tokens, metrics=dict(self.metrics),
                             prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
                             lora_request=None if (lora := self.streams[0].seq.lora) is None else lora.request)


class _NoText:
    """The detokenizer of a request with detokenize=False (vLLM's): token ids only, the text stays ""."""

    streaming = True
    text = ""

    def add(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


@dataclass
class Finished:
    """A sequence a step ended, and why (for the scheduler to retire once the step's tokens are accounted)."""

    seq: Sequence
    reason: str  # "stop" | "length"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], seqs: list[Sequence],
                    params: SamplingParams, arrival: float) -> None:
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        streams = []
        for seq in seqs:
            # Text nobody reads until the end is decoded once, at the end, unless stop strings must watch it.
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                streaming=not final_only or bool(params.stop)) if params.detokenize else _NoText()
            wants_logprobs = params.logprobs is not None
            streams.append(SeqStream(seq, detok, StopStringMatcher(params.stop, params.include_stop_str_in_output),
                                     logprobs=[] if wants_logprobs else None,
                                     cumulative_logprob=0.0 if wants_logprobs else None))
        self.requests[request_id] = RequestState(request_id, prompt, prompt_ids, streams, arrival, final_only,
                                                 delta=params.output_kind is RequestOutputKind.DELTA)

    def abort(self, request_id: str) -> RequestState | None:
        """Forget the request; its state carries the text of the tokens it got (the scheduler retires it)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for stream in state.streams:
                if not stream.detokenizer.streaming:
                    stream.text += stream.detokenizer.finish()  # "" if it finished
        return state

    def started(self, request_id: str) -> bool:
        """Whether any of the request's sequences has left the queue (or the request is gone)."""
        state = self.requests.get(request_id)
        seq = state.streams[0].seq if state is not None else None
        return seq is None or seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens > 0

    # ----- a step's tokens -----

    def append(self, scheduled: list[ScheduledSeq], tokens: list[list[int]],
               logprobs: list[tuple | None] | None = None) -> tuple[list[int], list[Finished], list[RequestState]]:
        """Append each scheduled sequence's new tokens (a row of `tokens` per chunk: one token for a single step, a
        burst's tokens in order, or a speculative step's accepted drafts and the token after them; chunks that do not
        sample are skipped; a chunk's logprobs are one tuple, or a list of one per token), stopping a sequence at its
        first stop condition -> (tokens appended per chunk, the sequences that ended, the requests that changed)."""
        appended, finished, changed = [], [], {}
        now = time.monotonic()
        for row, chunk in enumerate(scheduled):
            seq = chunk.seq
            if not chunk.sample or seq.is_finished:
                appended.append(0)
                continue
            state = self.requests[seq.request_id]
            stream = state.streams[seq.index]
            count = 0
            row_logprobs = None if logprobs is None else logprobs[row]  # a list: one per token (speculative step)
            for token in tokens[row]:
                token_logprobs = row_logprobs[count] if isinstance(row_logprobs, list) else row_logprobs
                count += 1
                reason = self._append_token(stream, token, token_logprobs)
                if reason is not None:
                    finished.append(Finished(seq, reason))
                    break
            appended.append(count)
            state.first_token_time = state.first_token_time or now
            changed[state.request_id] = state
        return appended, finished, list(changed.values())

    def _append_token(self, stream: SeqStream, token: int, logprobs: tuple | None) -> str | None:
        """-> the finish reason if this token ends the sequence."""
        seq, params = stream.seq, stream.seq.params
        seq.append_token(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if stream.logprobs is not None and logprobs is not None:
            chosen, top_ids, top_lps, rank = logprobs  # (chosen, top ids, top logprobs, chosen's rank)
            stream.logprobs.append(self._logprob_entry(params, params.logprobs, token, chosen, rank, top_ids,
                                                       top_lps))
            stream.cumulative_logprob += float(chosen)
        reason, stop_reason = None, None
        ends_on_eos = not params.ignore_eos and token in params.eos_token_ids  # the engine's, set per request
        # The length is tested before the stop tokens (vLLM v1's check_stop): a stop token sampled as the last
        # token allowed ends the sequence with "length", its text rendered as any other token's.
        at_limit = seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        if (ends_on_eos or token in params.stop_token_ids) and seq.num_output_tokens > params.min_tokens \
                and not at_limit:
            # The stop token's own text is output only with include_stop_str_in_output, and then as
            # skip_special_tokens renders it (an EOS is usually special: no text), as in vLLM. Text held back before
            # it (half a character) is output.
            reason, stop_reason = "stop", token
            kept = stream.detokenizer.add(token) if params.include_stop_str_in_output else ""
            delta = kept + stream.detokenizer.finish()
        else:
            delta = stream.detokenizer.add(token)
            if at_limit:
                reason = "length"
                delta += stream.detokenizer.finish()
        # Text produced by the first min_tokens tokens never takes part in stop-string matching (vLLM): it bypasses
        # the matcher, which therefore holds nothing back until min_tokens is reached.
        if params.stop and seq.num_output_tokens > params.min_tokens:
            emit, matched = stream.stop_matcher.feed(delta)
            if matched is not None:
                reason, stop_reason = "stop", matched
            elif reason is not None:
                emit += stream.stop_matcher.flush()
            delta = emit
        stream.text += delta
        if reason is not None:
            seq.stop_reason = stop_reason
        return reason

    def _logprob_entry(self, params: SamplingParams, k: int, token: int, chosen: float, rank: int,
                       top_ids: list[int], top_lps: list[float]) -> dict[int, Logprob]:
        """One position's {token id: Logprob}: the given token first (its rank from the sampler), then the top k
        (ranks 1..k), a token among both keeping its top-k entry, as vLLM builds them. decoded_token is the token's
        text alone as vLLM decodes it (tokenizer.decode([id]), special tokens shown), None without detokenize."""
        text = (lambda t: self.tokenizer.decode_token(t, skip_special_tokens=False)) if params.detokenize \
            else (lambda t: None)
        entry = {token: Logprob(chosen, rank, text(token))}
        for i, (t, lp) in enumerate(zip(top_ids[:k], top_lps[:k], strict=True)):
            entry[t] = Logprob(lp, i + 1, text(t))
        return entry

    def record_prompt_logprobs(self, scheduled: list[ScheduledSeq], wanted: list[bool], query_start: np.ndarray,
                               chosen: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray,
                               ranks: np.ndarray) -> None:
        """Logprobs of each prompt token given the tokens before it, from a step's all-token logprobs (rows follow
        the batch's tokens; query_start places each chunk; ranks: each prompt token's vocabulary rank)."""
        for row, chunk in enumerate(scheduled):
            if not wanted[row]:
                continue
            seq, k = chunk.seq, chunk.seq.params.prompt_logprobs
            stream = self.requests[seq.request_id].streams[seq.index]
            if stream.prompt_logprobs is None:
                stream.prompt_logprobs = [None] * seq.num_prompt_tokens  # the first token has no context
            for i in range(chunk.num_new_tokens):
                position = seq.num_computed_tokens + i + 1  # the prompt token this row's logits predict
                if position >= seq.num_prompt_tokens:
                    break
                r = query_start[row] + i
                stream.prompt_logprobs[position] = self._logprob_entry(
                    seq.params, k, seq.token_ids[position], float(chosen[r]),
                    int(ranks[r]), top_ids[r, :k].tolist(), top_lps[r, :k].tolist())

    # ----- what the caller sees -----

    def emit(self, changed: list[RequestState]) -> list[RequestOutput]:
        """The outputs of the requests that changed (a FINAL_ONLY request only once it finishes); finished requests
        are forgotten."""
        outputs = []
        for state in changed:
            if state.final_only and not state.finished:
                continue
            output = state.output()
            if state.finished:
                state.metrics.update(arrival_time=state.arrival_time, first_token_time=state.first_token_time or 0.0,
                                     finished_time=time.monotonic())
                output.metrics = dict(state.metrics)
                self.requests.pop(state.request_id, None)
            outputs.append(output)
        return outputs
