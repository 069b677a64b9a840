"""What an OpenAI client sees from `vllm-vcr serve`: readable text, structured outputs,
tool calls, logprobs and many concurrent streams, checked with the OpenAI Python SDK and
jsonschema.

Usage: python openai_checks.py BASE_URL MODEL [--frontend rs|python]
Prints one line per check and exits 1 if any failed.
"""

import asyncio
import json
import random
import re
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

BASE, MODEL = sys.argv[1], sys.argv[2]
EMBEDDINGS = "--embeddings" in sys.argv
ROUTES = "--routes" in sys.argv
FRONTEND = sys.argv[sys.argv.index("--frontend") + 1] if "--frontend" in sys.argv else "rs"
client = openai.OpenAI(base_url=BASE, api_key="none", timeout=120, max_retries=0)
failures = []

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check(name):
    def wrap(f):
        try:
            detail = f()
            print(f"PASS {name}" + (f": {detail}" if detail else ""), flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failures.append(name)
            print(f"FAIL {name}: {e!r}", flush=True)
            traceback.print_exc()
        return f

    return wrap


def readable(text):
    """Mostly letters, spaces and sentence punctuation: words a UI can show."""
    ok = sum(c.isalpha() or c in " ,." for c in text)
    assert text and ok / len(text) > 0.95, f"not readable text: {text!r}"
    words = text.split()
    assert len(words) >= 3, f"too few words: {text!r}"


def user(text="What is the weather like?"):
    return [{"role": "user", "content": text}]


def embedding_checks():
    @check("embeddings: unit vectors of the model's size, same text same vector")
    def _():
        r = client.embeddings.create(model=MODEL, input=["hello world", "hello world", "goodbye moon"])
        a, b, c = (d.embedding for d in r.data)
        assert len(a) == 64, len(a)
        assert a == b
        dot = lambda x, y: sum(p * q for p, q in zip(x, y))
        assert abs(dot(a, a) - 1) < 1e-4, dot(a, a)
        assert dot(a, c) < 0.99, dot(a, c)
        assert r.usage.prompt_tokens > 0, r.usage
        return f"cos(same)={dot(a, b):.3f}, cos(other)={dot(a, c):.3f}"

    @check("embeddings: dimensions truncates (Matryoshka)")
    def _():
        r = client.embeddings.create(model=MODEL, input="hello world", dimensions=8)
        v = r.data[0].embedding
        assert len(v) == 8 and abs(sum(x * x for x in v) - 1) < 1e-4, v

    @check("embeddings: float and base64 encodings agree")
    def _():
        import base64
        import struct
        f = client.embeddings.create(model=MODEL, input="abc", encoding_format="float").data[0].embedding
        raw = client.with_raw_response.embeddings.create(model=MODEL, input="abc", encoding_format="base64")
        b = json.loads(raw.text)["data"][0]["embedding"]
        g = struct.unpack(f"<{len(f)}f", base64.b64decode(b))
        assert max(abs(x - y) for x, y in zip(f, g)) < 1e-6

    @check("score: a text scores 1 against itself, less against another")
    def _():
        import urllib.request
        body = json.dumps({"model": MODEL, "text_1": "the river", "text_2": ["the river", "a stone bridge"]})
        req = urllib.request.Request(BASE.removesuffix("/v1") + "/v1/score", body.encode(), {"Content-Type": "application/json"})
        data = json.load(urllib.request.urlopen(req, timeout=60))["data"]
        s = [d["score"] for d in data]
        assert abs(s[0] - 1) < 1e-4 and s[1] < s[0], s
        return f"scores {s[0]:.3f}, {s[1]:.3f}"

    print(f"{FRONTEND}: {len(failures)} failed" + (f": {failures}" if failures else ""), flush=True)
    sys.exit(1 if failures else 0)


if EMBEDDINGS:
    embedding_checks()


def http(method, path, body=None):
    import urllib.request
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(BASE.removesuffix("/v1") + path, data, {"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    return json.loads(raw) if raw.startswith(("{", "[")) else raw


def route_checks():
    """The frontends' other routes, against a serve started with an `sql` LoRA adapter
    (--enable-lora --lora-modules), --enable-scale-out and an inter-token latency."""

    @check("LoRA: the adapter is a model, and vllm:lora_requests_info names it while it runs")
    def _():
        models = {m.id: m for m in client.models.list().data}
        assert "sql" in models, list(models)
        import threading
        done = {}

        def run():
            s = client.completions.create(model="sql", prompt="select", max_tokens=80, stream=True)
            done["text"] = "".join(c.choices[0].text for c in s if c.choices)

        t = threading.Thread(target=run)
        t.start()
        seen = None
        for _ in range(200):
            metrics = http("GET", "/metrics")
            seen = next((l for l in metrics.splitlines()
                         if l.startswith("vllm:lora_requests_info") and 'running_lora_adapters="sql"' in l), None)
            if seen or not t.is_alive():
                break
            import time
            time.sleep(0.02)
        t.join()
        assert seen, "vllm:lora_requests_info never named the running adapter"
        readable(done["text"])
        return seen

    @check("token-in/token-out: /inference/v1/generate")
    def _():
        r = http("POST", "/inference/v1/generate",
                 {"model": MODEL, "token_ids": list(range(40, 60)), "sampling_params": {"max_tokens": 6}})
        c = r["choices"][0]
        assert len(c["token_ids"]) == 6 and c["finish_reason"] == "length", r
        return f"{len(c['token_ids'])} token ids back"

    if FRONTEND.startswith("python"):
        @check("/v1/responses with store, then retrieval by id")
        def _():
            r = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=24, store=True)
            assert r.status in ("completed", "incomplete"), r.status
            readable(r.output_text)
            back = client.responses.retrieve(r.id)
            assert back.id == r.id and back.output_text == r.output_text, (back.id, back.output_text)
            return repr(r.output_text[:40])

    print(f"{FRONTEND}: {len(failures)} failed" + (f": {failures}" if failures else ""), flush=True)
    sys.exit(1 if failures else 0)


if ROUTES:
    route_checks()


@check("chat: readable text, length finish, usage")
def _():
    r = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=40)
    c = r.choices[0]
    readable(c.message.content)
    assert c.finish_reason == "length", c.finish_reason
    assert r.usage.completion_tokens == 40, r.usage
    return repr(c.message.content[:60])


@check("chat stream: deltas add up, usage in the last chunk")
def _():
    s = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in s:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    readable(text)
    assert finish == "length" and usage.completion_tokens == 30, (finish, usage)


@check("completions: text, streaming and not")
def _():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60)
    readable(r.choices[0].text)
    s = client.completions.create(model=MODEL, prompt="Once", max_tokens=60, stream=True)
    readable("".join(c.choices[0].text for c in s if c.choices))


@check("chat: same seed, same text")
def _():
    a, b = (
        client.chat.completions.create(model=MODEL, messages=user(), max_tokens=20, seed=11)
        .choices[0].message.content
        for _ in range(2)
    )
    assert a == b, (a, b)


@check("response_format json_object")
def _():
    for i in range(5):
        r = client.chat.completions.create(
            model=MODEL, messages=user(f"json please {i}"), max_tokens=400,
            response_format={"type": "json_object"},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        assert isinstance(json.loads(c.message.content), dict), c.message.content


def random_schema(rng, depth=0):
    """Nested objects, arrays, enums, bounded numbers, required and optional keys."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string"}
        if rng.random() < 0.3:
            s["maxLength"] = rng.randint(3, 20)
        return s
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if k == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "amber", "north", "south"], rng.randint(1, 4))}
    if k == "array":
        a = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            a["minItems"] = rng.randint(0, 2)
            a["maxItems"] = a["minItems"] + rng.randint(0, 3)
        return a
    props = {f"k{j}_{rng.choice(['name', 'size', 'kind', 'note'])}": random_schema(rng, depth + 1)
             for j in range(rng.randint(1, 4))}
    req = [p for p in props if rng.random() < 0.6]
    s = {"type": "object", "properties": props, "required": req}
    if rng.random() < 0.5:
        s["additionalProperties"] = False
    return s


@check("response_format json_schema: 50 random schemas parse and validate")
def _():
    rng = random.Random(1234)
    schemas = []
    while len(schemas) < 50:
        s = random_schema(rng)
        if s.get("type") == "object":
            schemas.append(s)

    def one(i):
        s = schemas[i]
        r = client.chat.completions.create(
            model=MODEL, messages=user(f"schema {i}"), max_tokens=1500,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (i, c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), s)
        return len(c.message.content)

    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(one, range(len(schemas))))
    return f"{len(sizes)} instances, {min(sizes)}-{max(sizes)} chars"


@check("json_schema cut by max_tokens: finish length, cut JSON")
def _():
    s = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}},
         "required": ["story"]}
    r = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": s}},
    )
    c = r.choices[0]
    assert c.finish_reason == "length", c.finish_reason
    assert c.message.content.startswith('{"story": "'), c.message.content
    try:
        json.loads(c.message.content)
        raise AssertionError(f"a cut instance parsed: {c.message.content!r}")
    except json.JSONDecodeError:
        pass


@check("regex and choice through structured_outputs")
def _():
    rx = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
    for i in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=user(f"mail {i}"), max_tokens=60,
            extra_body={"structured_outputs": {"regex": rx}},
        )
        assert re.fullmatch(rx, r.choices[0].message.content), r.choices[0].message.content
        r = client.chat.completions.create(
            model=MODEL, messages=user(f"pick {i}"), max_tokens=20,
            extra_body={"structured_outputs": {"choice": ["left", "right", "straight on"]}},
        )
        assert r.choices[0].message.content in ("left", "right", "straight on"), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


def valid_calls(calls, only=None):
    assert calls, "no tool calls"
    for call in calls:
        name = call.function.name
        assert name in SCHEMAS, name
        if only:
            assert name == only, (name, only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    return [(c.function.name, c.function.arguments) for c in calls]


@check("tool_choice required: a valid call")
def _():
    r = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=300, tools=TOOLS, tool_choice="required",
    )
    return valid_calls(r.choices[0].message.tool_calls)[0]


@check("tool_choice named: a valid call to that function")
def _():
    r = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=300, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    return valid_calls(r.choices[0].message.tool_calls, only="get_time")[0]


@check("tool_choice auto: calls and text both occur (--tool-call-rate 0.5)")
def _():
    calls = texts = 0
    for i in range(12):
        r = client.chat.completions.create(
            model=MODEL, messages=user(f"question {i}"), max_tokens=300, tools=TOOLS, seed=i,
        )
        m = r.choices[0]
        if m.message.tool_calls:
            valid_calls(m.message.tool_calls)
            assert m.finish_reason == "tool_calls", m.finish_reason
            calls += 1
        else:
            readable(m.message.content)
            texts += 1
    assert calls >= 2 and texts >= 2, (calls, texts)
    return f"{calls} calls, {texts} text answers"


STRICT_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@check("strict tool under auto (the Agents SDK's default): calls follow the schema, a result gets text")
def _():
    # issue 22 H6: the frontends turn a strict tool into a `triggered_tags` structural tag,
    # which the engine refused (HTTP 500)
    calls = texts = 0
    for i in range(12):
        msgs = user(f"time {i}")
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=300, tools=[STRICT_TIME], seed=i,
        )
        m = r.choices[0]
        if not m.message.tool_calls:
            readable(m.message.content)
            texts += 1
            continue
        valid_calls(m.message.tool_calls, only="get_time")
        assert m.finish_reason == "tool_calls", m.finish_reason
        calls += 1
        call = m.message.tool_calls[0]
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "12:00"})
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=60, tools=[STRICT_TIME], seed=i,
        )
        assert not r.choices[0].message.tool_calls, r.choices[0].message.tool_calls
        readable(r.choices[0].message.content)
    assert calls >= 2 and texts >= 2, (calls, texts)
    return f"{calls} calls (each answered after its result), {texts} text answers"


@check("streamed tool call: the deltas add up to a valid call")
def _():
    s = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=300, tools=TOOLS, tool_choice="required",
        stream=True,
    )
    name, args = None, ""
    for chunk in s:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.index == 0:
                    name = tc.function.name or name
                    args += tc.function.arguments or ""
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(args), SCHEMAS[name])


@check("three-turn tool loop: call, tool result, answer")
def _():
    msgs = user("Weather in Paris for 2 days?")
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=300, tools=TOOLS, tool_choice="required",
    )
    call = r.choices[0].message.tool_calls[0]
    valid_calls([call])
    msgs.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, tools=TOOLS)
    m = r.choices[0].message
    assert not m.tool_calls, m.tool_calls
    readable(m.content)
    return repr(m.content[:50])


@check("logprobs: one entry per token, top_logprobs alternatives")
def _():
    r = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=12, logprobs=True, top_logprobs=2,
    )
    lp = r.choices[0].logprobs.content
    assert len(lp) == 12, len(lp)
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp), lp[0]


@check("200 concurrent streams")
def _():
    aclient = openai.AsyncOpenAI(base_url=BASE, api_key="none", timeout=120, max_retries=0)

    async def one(i):
        s = await aclient.chat.completions.create(
            model=MODEL, messages=user(f"stream {i}"), max_tokens=16, stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in s:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main():
        got = await asyncio.gather(*(one(i) for i in range(200)))
        await aclient.close()
        return got

    got = asyncio.run(main())
    assert got == [16] * 200, sorted(set(got))


print(f"{FRONTEND}: {len(failures)} failed" + (f": {failures}" if failures else ""), flush=True)
sys.exit(1 if failures else 0)
