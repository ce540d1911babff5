"""`jserve generate`: a resumable batch job from a JSONL file of prompts to a JSONL file of results (texts, or with an
embedding model, runner "pooling", embeddings).

Each result is written and flushed the moment its request finishes, so an interrupted job keeps what it did;
a rerun skips the ids already present in the output file. Both files are UTF-8, as JSON Lines are, whatever the
locale's encoding.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from jserve.config import EngineConfig
from jserve.outputs import EmbeddingRequestOutput, RequestOutput
from jserve.pooling_params import PoolingParams
from jserve.sampling_params import SAMPLING_FIELDS, RequestOutputKind, SamplingParams, with_defaults

# A line may set any SamplingParams field but output_kind (the job writes finished results only); any other key is
# a malformed line, so a typo (or another library's name, such as max_new_tokens) is not silently ignored.
_SAMPLING_FIELDS = SAMPLING_FIELDS - {"output_kind"}
_LINE_FIELDS = {"id", "prompt", "messages", "priority", "model"}  # model: a --lora-modules adapter's name
# An embedding model's line: its prompt (text or ids) and PoolingParams' fields.
_POOLING_FIELDS = {"id", "prompt", "priority", "dimensions", "normalize", "truncate_prompt_tokens"}
# max_tokens of a line that sets none, where neither --max-tokens nor the model's generation_config.json says.
DEFAULT_MAX_TOKENS = 128


@dataclass
class BatchItem:
    id: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding model's line
    priority: int = 0
    given: frozenset[str] = frozenset()  # the line's sampling fields: the model's defaults fill the rest
    model_max_tokens: bool = False  # no max_tokens on the line or the command line: the model's max_new_tokens
    model: str | None = None  # the LoRA adapter it runs with, by its --lora-modules name (None: the base model)


class MalformedLine(ValueError):
    pass


def parse_line(line: str, line_no: int, default_max_tokens: int | None = None) -> BatchItem:
    """One input line. default_max_tokens (--max-tokens) is the max_tokens of a line that sets none; None: the
    model's generation_config.json max_new_tokens where it has one (run_batch fills it in), else 128."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise MalformedLine(f"line {line_no}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise MalformedLine(f"line {line_no}: expected a JSON object")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise MalformedLine(f"line {line_no}: needs exactly one of 'prompt' or 'messages'")
    unknown = [k for k in obj if k not in _SAMPLING_FIELDS and k not in _LINE_FIELDS]
    if unknown:
        raise MalformedLine(f"line {line_no}: unknown field(s) {', '.join(map(repr, unknown))}; a line takes "
                            f"{', '.join(sorted(_LINE_FIELDS))} and SamplingParams' fields but output_kind")
    fields = {k: v for k, v in obj.items() if k in _SAMPLING_FIELDS}
    given = frozenset(k for k, v in fields.items() if v is not None)
    if isinstance(fields.get("logit_bias"), dict):  # JSON object keys are strings
        try:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        except ValueError:
            raise MalformedLine(f"line {line_no}: logit_bias keys must be token ids") from None
    model_max_tokens = "max_tokens" not in fields and default_max_tokens is None
    fields.setdefault("max_tokens", DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens)
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise MalformedLine(f"line {line_no}: {e}") from None
    item_id = str(obj.get("id", f"line-{line_no}"))
    priority = obj.get("priority", 0)
    if not isinstance(priority, int):
        raise MalformedLine(f"line {line_no}: priority must be an integer")
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise MalformedLine(f"line {line_no}: model must be a LoRA adapter's name (a non-empty string)")
    return BatchItem(item_id, obj.get("prompt"), obj.get("messages"), params, priority, given, model_max_tokens,
                     model)


def drop_torn_last_line(output: Path) -> None:
    """Cut a last line that an interruption left without its newline, so appended results start clean."""
    if not output.exists():
        return
    with open(output, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_done_ids(output: Path) -> set[str]:
    done = set()
    if output.exists():
        # errors="replace": a file another program wrote in another encoding still yields its (ASCII) ids.
        for line in output.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by an interruption: that request reruns
    return done


def parse_pooling_line(line: str, line_no: int) -> tuple[str, str | list[int], PoolingParams, int]:
    """One input line of an embedding job -> (id, prompt, its PoolingParams, priority)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise MalformedLine(f"line {line_no}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise MalformedLine(f"line {line_no}: an embedding model's line is a JSON object with a 'prompt'")
    unknown = [k for k in obj if k not in _POOLING_FIELDS]
    if unknown:
        raise MalformedLine(f"line {line_no}: unknown field(s) {', '.join(map(repr, unknown))}; an embedding model's "
                            f"line takes {', '.join(sorted(_POOLING_FIELDS))}")
    try:
        params = PoolingParams(**{k: obj[k] for k in ("dimensions", "normalize", "truncate_prompt_tokens") if k in obj})
    except (TypeError, ValueError) as e:
        raise MalformedLine(f"line {line_no}: {e}") from None
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise MalformedLine(f"line {line_no}: priority must be an integer")
    return str(obj.get("id", f"line-{line_no}")), obj["prompt"], params, priority


def _logprobs_json(entry: dict[int, float] | None) -> dict | None:
    """One position's logprobs, {chosen id: lp, top ids: lps} (the chosen token first), as JSON (whose object keys
    cannot stay integers): the chosen token and its logprob, and every token of the entry (the top ones, and the
    chosen one if it is not among them, as vLLM lists them) by descending logprob."""
    if entry is None:
        return None  # the first prompt token: nothing precedes it
    (token, logprob), *_ = entry.items()
    top = [{"token_id": t, "logprob": lp} for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])]
    return {"token_id": token, "logprob": logprob, "top_logprobs": top}


def result_record(item_id: str, output: RequestOutput | EmbeddingRequestOutput, model: str | None = None) -> dict:
    """A finished request as a JSONL record; logprobs and prompt_logprobs appear when the line asked for them, model
    (the adapter's name) when the line named one. An embedding's record holds its vector."""
    if isinstance(output, EmbeddingRequestOutput):
        return {"id": item_id, "prompt": output.prompt, "embedding": output.outputs.embedding,
                "usage": {"prompt_tokens": len(output.prompt_token_ids)}}
    choices = []
    for c in output.outputs:
        choice = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if c.logprobs is not None:
            choice["logprobs"] = [_logprobs_json(entry) for entry in c.logprobs]
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    record = {"id": item_id, "prompt": output.prompt, "text": choices[0]["text"], "choices": choices,
              "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion_tokens,
                        "cached_tokens": output.num_cached_tokens}}
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = [_logprobs_json(entry) for entry in output.prompt_logprobs]
    if model is not None:
        record["model"] = model
    return record


def run_batch(config: EngineConfig, input_path: Path, output_path: Path, *, strict: bool = False,
              default_max_tokens: int | None = None, loras: dict[str, str] | None = None) -> int:
    """loras: LoRA adapters by name (--lora-modules: name -> PEFT directory), which a line's `model` picks; each is
    read when the engine starts, so a bad one stops the job before any request runs."""
    from jserve.engine.data_parallel import create_engine
    from jserve.lora import LoRAError, LoRARequest

    if not input_path.is_file():
        raise ValueError(f"{input_path}: no such input file")
    if loras and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    adapters = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate((loras or {}).items(), start=1)}
    drop_torn_last_line(output_path)
    done = read_done_ids(output_path)
    items, errors = [], 0
    pooling = config.runner == "pooling"
    for line_no, line in enumerate(input_path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = _pooling_item(line, line_no) if pooling else parse_line(line, line_no, default_max_tokens)
        except MalformedLine as e:
            if strict:
                raise
            print(f"jserve: skipping {e}", file=sys.stderr)
            errors += 1
            continue
        if item.id not in done:
            items.append(item)
    engine = create_engine(config)
    for lora in adapters.values():
        try:
            engine.add_lora(lora)
        except LoRAError as e:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: {e}") from None
    pending: dict[str, BatchItem] = {}
    for item in items:
        try:
            if item.model is not None and item.model not in adapters:
                raise ValueError(f"model {item.model!r} is not a LoRA adapter of --lora-modules "
                                 f"({', '.join(adapters) or 'none given'})")
            prompt = item.prompt
            if pooling:
                engine.add_request(item.id, prompt, item.params, priority=item.priority)
                pending[item.id] = item
                continue
            if item.messages is not None:
                prompt = {"prompt_token_ids": engine.tokenizer.apply_chat_template(item.messages)}
            params = with_defaults(item.params, item.given, engine.sampling_defaults)  # the model's, as the server
            if item.model_max_tokens and "max_tokens" in engine.sampling_defaults:
                params = params.clone(max_tokens=None)  # the engine stops it at max_new_tokens (or the context)
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)  # only results are written
            # A max_tokens the line did not ask for ends at the context; one it asked for past it is refused.
            engine.add_request(item.id, prompt, params, priority=item.priority,
                               cap_max_tokens="max_tokens" not in item.given,
                               lora_request=adapters.get(item.model) if item.model is not None else None)
            pending[item.id] = item
        except ValueError as e:
            if strict:
                raise ValueError(f"request {item.id}: {e}") from None
            print(f"jserve: skipping request {item.id}: {e}", file=sys.stderr)
            errors += 1
    written = 0
    with open(output_path, "a", encoding="utf-8") as out, \
            tqdm(total=len(pending), desc="Embedding" if pooling else "Generating", unit="req") as bar:
        while pending:
            for output in engine.step():
                if output.finished:
                    model = pending[output.request_id].model if output.request_id in pending else None
                    record = result_record(output.request_id, output, model)
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
                    pending.pop(output.request_id, None)
                    written += 1
                    bar.update(1)
    print(f"jserve: wrote {written} results to {output_path}"
          f" ({len(done)} already present, {errors} skipped)", file=sys.stderr)
    return 0


def _pooling_item(line: str, line_no: int) -> BatchItem:
    item_id, prompt, params, priority = parse_pooling_line(line, line_no)
    return BatchItem(item_id, prompt, None, params, priority)
