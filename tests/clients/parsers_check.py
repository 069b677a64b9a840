"""Answers the engine wrote, read by the Python frontend's own tool-call and reasoning parsers.

Usage: parsers_check.py MODEL_DIR < cases.jsonl, one case per line:
{"label": ..., "tools": [...], "text": ..., "tool_parser": NAME} or {..., "reasoning_parser": NAME}
(and optionally "chat_template_kwargs": {...}, what the request would send: DeepSeek-V3's
reasoning parser reads thinking only when the request turns it on).
Prints one JSON line per case: the tool calls (name, arguments text) and content the tool
parser extracts, or the reasoning and content the reasoning parser splits. A parser that
fails to start or to read prints {"label": ..., "error": ...}.

A parser whose frontend path is a parser of its own family rather than the tool or reasoning
parser class alone (Cohere Command's, read by `cohere_melody`; Kimi K3's; MiniCPM-V's: the
frontend composes them in `ParserManager`) is read through that composed parser's `parse`,
as the frontend reads it. So are `hf` and `beam`, one parser of the response_template in
MODEL_DIR's tokenizer_config.json for calls and thinking. gpt-oss's harmony (`openai` calls, `openai_gptoss` thinking) is read
from token ids of its own vocabulary (o200k_harmony, which the harmony package ships): the
ids of the engine's text in it, what a model with gpt-oss's tokenizer would have written.
"""

import json
import sys

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
from vllm.parser.abstract_parser import DelegatingParser
from vllm.parser.parser_manager import ParserManager
from vllm.reasoning import ReasoningParserManager
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers import ToolParserManager


def main() -> None:
    tokenizer = get_tokenizer(sys.argv[1])
    for line in sys.stdin:
        case = json.loads(line)
        out = {"label": case["label"]}
        try:
            request = ChatCompletionRequest(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                tools=case["tools"] or None,
                tool_choice="auto" if case["tools"] else "none",
            )
            harmony = case.get("tool_parser") == "openai" or (
                case.get("reasoning_parser") == "openai_gptoss"
            )
            composed = ParserManager.get_parser(
                tool_parser_name=case.get("tool_parser"),
                reasoning_parser_name=case.get("reasoning_parser"),
                enable_auto_tools=True,
                is_harmony=harmony,
            )
            if composed is not None and (
                harmony or composed.__bases__ != (DelegatingParser,)
            ):
                kwargs = case.get("chat_template_kwargs") or {}
                parser = composed(tokenizer, request.tools, chat_template_kwargs=kwargs)
                ids = (
                    get_encoding().encode(case["text"], allowed_special="all")
                    if harmony
                    else ()
                )
                reasoning, content, calls = parser.parse(
                    case["text"],
                    request,
                    enable_auto_tools=True,
                    model_output_token_ids=ids,
                )
                if "tool_parser" in case:
                    out["calls"] = [
                        {"name": c.name, "arguments": c.arguments} for c in calls or []
                    ]
                else:
                    out["reasoning"] = reasoning
                out["content"] = content
            elif "tool_parser" in case:
                cls = ToolParserManager.get_tool_parser(case["tool_parser"])
                try:
                    # the request's tools as the frontend hands them over: parsers that
                    # convert spelled arguments by the tool's schema find it there
                    parser = cls(tokenizer, request.tools)
                except TypeError:
                    parser = cls(tokenizer)
                got = parser.extract_tool_calls(case["text"], request)
                out["calls"] = [
                    {"name": c.function.name, "arguments": c.function.arguments}
                    for c in got.tool_calls
                ]
                out["content"] = got.content
            else:
                cls = ReasoningParserManager.get_reasoning_parser(case["reasoning_parser"])
                kwargs = case.get("chat_template_kwargs") or {}
                parser = cls(tokenizer, chat_template_kwargs=kwargs)
                reasoning, content = parser.extract_reasoning(case["text"], request)
                out["reasoning"] = reasoning
                out["content"] = content
        except Exception as e:  # a parser's failure is the check's answer, not a crash
            out["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
