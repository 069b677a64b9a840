"""LangChain's `ChatOpenAI` against `vllm-vcr serve`: tools bound with `bind_tools` (the model
is made to call one; the call reaches LangChain parsed, its arguments valid for the tool's
schema), a tool result sent back and answered in text, and `with_structured_output` in
each of its methods: a JSON schema and a function call parsed into the caller's pydantic
type, and JSON mode (the server is told only "a JSON object", so nothing constrains its
keys: a real model follows the prompt, the stand-in writes some object) parsed as a dict.

Usage: python langchain_check.py BASE_URL MODEL LABEL
Prints one line per check and exits 1 if any failed.
"""

import sys
from typing import Literal

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

BASE, MODEL, LABEL = sys.argv[1], sys.argv[2], sys.argv[3]
failures = []


def check(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} langchain {LABEL}: {name}: {detail}")
    if not ok:
        failures.append(name)


@tool
def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city.

    Args:
        city: The city.
        days: How many days ahead.
    """
    return f"sunny in {city} for {days} days"


class Forecast(BaseModel):
    """A forecast."""

    city: str = Field(description="The city")
    days: int = Field(description="How many days ahead")
    sky: Literal["sunny", "cloudy", "rain"]


def chat(max_tokens=120, **kwargs):
    return ChatOpenAI(
        model=MODEL,
        base_url=BASE,
        api_key="none",
        max_tokens=max_tokens,
        timeout=120,
        max_retries=0,
        **kwargs,
    )


def run():
    # bind_tools, the model made to call the tool, then the tool's result answered in text
    llm = chat().bind_tools([get_weather], tool_choice="required")
    question = HumanMessage("What is the weather in Paris for the next 3 days?")
    first = llm.invoke([question])
    calls = first.tool_calls
    bad = first.invalid_tool_calls
    ok = bool(calls) and not bad
    for call in calls:
        args = call["args"]
        ok = ok and call["name"] == "get_weather"
        ok = ok and isinstance(args.get("city"), str) and isinstance(args.get("days"), int)
        ok = ok and set(args) <= {"city", "days"} and bool(call.get("id"))
    check(
        "bind_tools: every call parsed and valid for the schema",
        ok,
        f"{len(calls)} call(s) {[c['args'] for c in calls]}, {len(bad)} invalid",
    )
    if not ok:
        return
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in calls]
    second = chat().bind_tools([get_weather]).invoke([question, first, *results])
    text = second.content if isinstance(second.content, str) else ""
    check(
        "bind_tools: the tool's result answered",
        bool(text.strip()) or bool(second.tool_calls),
        f"{len(text)} characters, {len(second.tool_calls)} further call(s), "
        f"finish {second.response_metadata.get('finish_reason')}",
    )
    usage = second.usage_metadata or {}
    check(
        "bind_tools: usage counted",
        usage.get("input_tokens", 0) > 0 and usage.get("output_tokens", 0) > 0,
        f"{usage}",
    )

    # with_structured_output, each method LangChain offers for an OpenAI-compatible server
    prompt = "Give the forecast for Paris, 3 days ahead, as JSON with city, days and sky."
    for method, schema, want in (
        ("json_schema", Forecast, Forecast),
        ("function_calling", Forecast, Forecast),
        ("json_mode", Forecast.model_json_schema(), dict),
    ):
        try:
            # room for the whole object: a string the schema leaves unbounded can run long,
            # and an object cut at max_tokens is no object (LangChain then returns None)
            out = (
                chat(max_tokens=1000)
                .with_structured_output(schema, method=method, include_raw=True)
                .invoke(prompt)
            )
            raw = out["raw"]
            check(
                f"with_structured_output({method})",
                isinstance(out["parsed"], want) and out["parsing_error"] is None,
                f"{out['parsed']!r} (finish {raw.response_metadata.get('finish_reason')}, "
                f"error {out['parsing_error']!r}, raw {raw.content!r} {raw.tool_calls!r})",
            )
        except Exception as e:  # noqa: BLE001 - every failure is reported as a check
            check(f"with_structured_output({method})", False, f"{type(e).__name__}: {e}")


try:
    run()
except Exception as e:  # noqa: BLE001
    check("run", False, f"{type(e).__name__}: {e}")
print(f"langchain {LABEL}: {len(failures)} failed")
sys.exit(1 if failures else 0)
