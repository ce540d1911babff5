"""Reasoning parsers (vLLM's --reasoning-parser): outputs in the formats their models document split into reasoning,
content and (gpt-oss) tool calls; streams that reassemble to the same split whatever the pieces; and a live server on
the demo model, through the official `openai` client, returning message.reasoning_content beside content and tool
calls (the demo model's output forced into a thinking model's shape by a regex)."""

from __future__ import annotations

import re

import openai
import pytest
import transformers
from hf_models import build_model, save_tokenizer
from server_helpers import TEST_ENGINE_ARGS, ServerThread

from checkpoints import DEMO_MODEL_DIR
from jserve.config import EngineConfig
from jserve.server.protocol import APIError
from jserve.server.reasoning import ReasoningStream, split_reasoning
from jserve.server.settings import ServerSettings
from jserve.server.tools import parse_tool_request

# OpenAI's harmony format guide: a final answer after analysis; a tool call; a preamble on commentary before a call.
HARMONY_ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
                  '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')
HARMONY_CALL = ('<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>'
                '{"location":"San Francisco"}<|call|>')
HARMONY_PREAMBLE = ('<|channel|>analysis<|message|>We need to build a website.<|end|><|start|>assistant<|channel|>'
                    'commentary<|message|>**Action plan**: 1. Generate an HTML file 2. Start the server<|end|>'
                    '<|start|>assistant to=functions.generate_file<|channel|>commentary <|constrain|>json<|message|>'
                    '{"template": "basic_html", "path": "index.html"}<|call|>')

# (parser, output, reasoning, content, calls)
CASES = [
    ("openai_gptoss", HARMONY_ANSWER, 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.",
     []),
    ("openai_gptoss", HARMONY_CALL, "Need to use function get_current_weather.", "",
     [("get_current_weather", '{"location":"San Francisco"}')]),
    ("openai_gptoss", HARMONY_PREAMBLE, "We need to build a website.",
     "**Action plan**: 1. Generate an HTML file 2. Start the server",
     [("generate_file", '{"template": "basic_html", "path": "index.html"}')]),
    ("openai_gptoss", "no harmony at all", "", "no harmony at all", []),
    # DeepSeek-R1: the template opens <think> in the prompt; the output closes it (or, cut short, never does)
    ("deepseek_r1", "Let me think: 3 < 4.\n</think>\n\nYes, 3 < 4.", "Let me think: 3 < 4.\n", "\n\nYes, 3 < 4.", []),
    ("deepseek_r1", "<think>a</think>b", "a", "b", []),
    ("deepseek_r1", "cut short while thinking </thi", "cut short while thinking </thi", "", []),
    # Qwen3 opens <think> itself; with enable_thinking false there is none
    ("qwen3", "<think>\nsmall talk\n</think>\n\nHello!", "\nsmall talk\n", "\n\nHello!", []),
    ("qwen3", "Hello! <think> is a tag.", "", "Hello! <think> is a tag.", []),
    ("qwen3", "<thin", "", "<thin", []),
]


@pytest.mark.parametrize("parser, text, reasoning, content, calls", CASES)
def test_outputs_split_as_their_formats_say(parser, text, reasoning, content, calls):
    split = split_reasoning(text, parser)
    assert (split.reasoning, split.content, split.calls) == (reasoning, content, calls)


@pytest.mark.parametrize("parser, text", [(c[0], c[1]) for c in CASES])
def test_streams_reassemble_to_the_whole_split_whatever_the_pieces(parser, text):
    """Pieces of one character, of several, and cut at every harmony marker: what is sent never has to be taken
    back, and the end sends what was held back."""
    whole = split_reasoning(text, parser)
    cuts = [list(text), [text[i:i + 3] for i in range(0, len(text), 3)],
            [p for p in re.split(r"(<\|[a-z]+\|>)", text) if p]]
    for pieces in cuts:
        stream, reasoning, content = ReasoningStream(parser), "", ""
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == (whole.reasoning, whole.content)


def test_a_stream_holds_back_what_may_be_a_marker():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi", final=False) == ("", "")
    assert stream.feed("nk>ok </th", final=False) == ("ok ", "")
    assert stream.feed("ink>done", final=True) == ("", "done")


def test_parser_settings_are_checked():
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerSettings(reasoning_parser="deepseek")
    with pytest.raises(ValueError, match="tool_call_parser openai reads gpt-oss's harmony messages"):
        ServerSettings(tool_call_parser="openai")
    ServerSettings(tool_call_parser="openai", reasoning_parser="openai_gptoss")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(APIError, match="serves tool_choice \"auto\" only"):
        parse_tool_request({"tools": tools, "tool_choice": "required"}, "openai")


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(model=str(DEMO_MODEL_DIR), **TEST_ENGINE_ARGS)
    server = ServerThread(config, ServerSettings(served_model_name="demo", reasoning_parser="qwen3",
                                                       tool_call_parser="hermes")).start()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


THOUGHT, ANSWER = r"[a-z]{2,8}( [a-z]{2,8}){1,3}", r"[A-Z][a-z]{2,8}( [a-z]{2,8}){0,2}"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


def test_reasoning_content_beside_content_streamed_and_not(client):
    kwargs = dict(model="demo", messages=MESSAGES, max_tokens=120, temperature=0,
                  extra_body={"structured_outputs": {"regex": f"<think>{THOUGHT}</think>{ANSWER}"}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert re.fullmatch(THOUGHT, message.reasoning_content) and re.fullmatch(ANSWER, message.content)
    assert streamed(client, kwargs) == {"reasoning_content": message.reasoning_content, "content": message.content}
    hide = {**kwargs, "extra_body": {**kwargs["extra_body"], "include_reasoning": False}}
    hidden = client.chat.completions.create(**hide).choices[0].message
    assert hidden.content == message.content and getattr(hidden, "reasoning_content", None) is None
    assert streamed(client, hide) == {"reasoning_content": "", "content": message.content}


def streamed(client: openai.OpenAI, kwargs: dict) -> dict[str, str]:
    """The stream's reasoning and content deltas, each joined."""
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for key in parts:
                parts[key] += getattr(choice.delta, key, None) or ""
    return parts


def test_a_tool_call_after_the_reasoning(client):
    """Qwen3's way: a <tool_call> block after </think>; the hermes parser reads it from the content."""
    call = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    choice = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=160, temperature=0, tools=tools,
        extra_body={"structured_outputs": {"regex": r"<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>" + call}}
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){0,2}", choice.message.reasoning_content)
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "add"
    assert re.fullmatch(r'\{"a": [1-9], "b": [1-9]\}', tool_call.function.arguments)


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]


@pytest.fixture(scope="module")
def gpt_oss_client(tmp_path_factory):
    """The tiny gpt-oss behind a server with both gpt-oss parsers; its tokenizer has harmony's special tokens and a
    template that renders harmony messages."""
    model_dir = build_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss_harmony"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_tokenizer(model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
                               "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    tokenizer.save_pretrained(model_dir)
    config = EngineConfig(model=str(model_dir), **TEST_ENGINE_ARGS)
    server = ServerThread(config, ServerSettings(served_model_name="oss", reasoning_parser="openai_gptoss",
                                                 tool_call_parser="openai")).start()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_gpt_oss_harmony_channels_through_the_server(gpt_oss_client):
    """The model's output, forced into harmony messages (special tokens and all) by a grammar: the analysis channel
    is the reasoning, final the content, streamed and not; a message to functions.add is a tool call."""
    answer = ('start: <|channel|> "analysis" <|message|> /[a-z]{2,8}( [a-z]{2,8}){1,3}/ <|end|> <|start|> "assistant" '
              '<|channel|> "final" <|message|> /[A-Z][a-z]{2,8}/')
    kwargs = dict(model="oss", messages=MESSAGES, max_tokens=100, temperature=0,
                  extra_body={"structured_outputs": {"grammar": answer}})
    message = gpt_oss_client.chat.completions.create(**kwargs).choices[0].message
    assert re.fullmatch(THOUGHT, message.reasoning_content) and re.fullmatch(r"[A-Z][a-z]{2,8}", message.content)
    assert streamed(gpt_oss_client, kwargs) == {"reasoning_content": message.reasoning_content,
                                                "content": message.content}
    call = ('start: <|channel|> "analysis" <|message|> /[a-z]{2,8}/ <|end|> <|start|> "assistant" <|channel|> '
            '"commentary to=functions.add " <|constrain|> "json" <|message|> /\\{"a": [1-9], "b": [1-9]\\}/ <|call|>')
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    choice = gpt_oss_client.chat.completions.create(
        **{**kwargs, "tools": tools, "extra_body": {"structured_outputs": {"grammar": call}}}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert re.fullmatch(r"[a-z]{2,8}", choice.message.reasoning_content)
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "add"
    assert re.fullmatch(r'\{"a": [1-9], "b": [1-9]\}', tool_call.function.arguments)
