"""The OpenAI Agents SDK's default agent loop against `vllm-vcr serve`: an agent with one
function tool (strict JSON schema, the SDK's default) asked something that needs it. The
first turn is made to call the tool (`tool_choice="required"`; the SDK resets it to auto
after the call; the model may make several calls at once), each call runs with its parsed
arguments, and the model answers in text.

Usage: python agents_check.py BASE_URL MODEL API   (API: `chat` for chat completions,
`responses` for the Responses API, the SDK's default)
Prints one line per check and exits 1 if any failed.
"""

import sys

from openai import AsyncOpenAI
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

BASE, MODEL, API = sys.argv[1], sys.argv[2], sys.argv[3]
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=BASE, api_key="none", timeout=120, max_retries=0)
calls = []


@function_tool
def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city.

    Args:
        city: The city.
        days: How many days ahead.
    """
    calls.append((city, days))
    return f"sunny in {city} for {days} days"


if API == "chat":
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
else:
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
agent = Agent(
    name="forecaster",
    instructions="Answer with the forecast; call get_weather for it.",
    tools=[get_weather],
    model=model,
    model_settings=ModelSettings(tool_choice="required"),
)
failures = []


def check(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} agents {API}: {name}: {detail}")
    if not ok:
        failures.append(name)


try:
    result = Runner.run_sync(agent, "What will the weather be in Paris?", max_turns=4)
except Exception as e:  # the whole loop failed: say how
    check("the agent loop completes", False, repr(e)[:400])
    sys.exit(1)
kinds = [type(i).__name__ for i in result.new_items]
check("the agent loop completes", True, f"items {kinds}")
# the model may call the tool more than once in its first response (parallel calls, as
# `tool_choice="required"` allows); every call runs, then the model answers in text
n = len(calls)
check(
    "the tool ran with arguments that parsed into its signature",
    n >= 1 and all(isinstance(c, str) and isinstance(d, int) for c, d in calls),
    f"calls {calls}",
)
check(
    "its calls, their outputs, then a text answer",
    kinds == ["ToolCallItem"] * n + ["ToolCallOutputItem"] * n + ["MessageOutputItem"],
    f"items {kinds}",
)
final = result.final_output
usage = result.raw_responses[-1].usage if result.raw_responses else None
check(
    "two model responses, the second a text answer",
    isinstance(final, str) and 0 < len(final) and len(result.raw_responses) == 2,
    f"{len(final or '')} characters, {getattr(usage, 'output_tokens', '?')} tokens",
)
print(f"agents {API}: {len(failures)} failed")
sys.exit(1 if failures else 0)
