"""Mainstream agent frameworks, unmodified, each running its OWN tool loop against the real session server and
`sglang-sim`, non-streaming and streaming; then the training data is checked against what the engine really saw.

The episode (scripted for the sim by `[[sim: ...]]` directives, which the tools append to their results, exactly as a
real environment returns text): reasoning + two parallel `lookup` calls, reasoning + one `calculator` call, a final
answer. Three model calls, so the session must hold exactly three committed turns, no rollback, a loss mask that is 1
on exactly the sampled tokens, and tokens equal to the `input_ids` the engine received and the `output_ids` (and
logprobs) it generated -- read from a recording proxy between the server and the sim, not from the server's records.

Each framework runs on qwen3 plain and streaming, and streaming on every other family (their own tool-call and
reasoning markup: DeepSeek's special tokens, Qwen3.5's XML calls after an opened `<think>`, DeepSeek V4's DSML; DeepSeek
V4's default is chat mode, so it does not reason there). Frameworks:
openai-agents 0.24, langchain-openai 1.7 + langgraph 1.2, pydantic-ai 2.62, litellm 1.83 (its own
completion API in the loop it documents). verifiers 0.4 is not installed (it would downgrade openai 3.x to 2.x in
the shared environment); its pattern -- one client for the whole run, one `X-Session-ID` per rollout at the root
URL -- is reproduced with the openai client.

Nothing may leave loopback: telemetry is switched off through each framework's own settings, and a guard on
`socket.connect`/`getaddrinfo` fails the test if anything still tries.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from support.families import CHAT_MODE_BY_DEFAULT, FAMILIES, NO_REASONING, ONE_CALL_PER_REPLY
from support.server import assert_training_data, metric, new_session
from support.stack import Stack, StackFactory

# Telemetry and remote lookups off, before any framework is imported (some read these at import time).
os.environ.update({
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_TRACING": "false",
    "LOGFIRE_IGNORE_NO_CONFIG": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
})

FAMILY = "qwen3"
MODEL = "qwen3"
SYSTEM = "You are a careful shopping assistant. Use the tools; answer briefly."


# -- the scripted environment --------------------------------------------------------------------------------------

def _directive_call(name: str, **args: Any) -> str:
    return f"[[sim: tool_call name={name} args={json.dumps(args)}]]"


@dataclass
class Shopping:
    """One episode's task: the price and quantity of an item, multiplied with the calculator."""

    item: str = "apple"
    price: int = 4
    quantity: int = 3
    parallel: bool = True  # both lookups in one model call; else one after the other (one call per completion)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (tool, argument) as the framework ran them

    @property
    def expression(self) -> str:
        return f"{self.price} * {self.quantity}"

    @property
    def answer(self) -> str:
        return f"The total for {self.item} is {self.price * self.quantity}."

    @property
    def user(self) -> str:
        return (f"What do the {self.item}s cost in total? Look up price and quantity, then use the calculator. "
                f"[[sim: think]] {_directive_call('lookup', key=f'price:{self.item}')} "
                f"{self._quantity_call if self.parallel else ''}")

    @property
    def _quantity_call(self) -> str:
        return _directive_call('lookup', key=f'quantity:{self.item}')

    def lookup(self, key: str) -> str:
        self.calls.append(("lookup", key))
        store = {f"price:{self.item}": self.price, f"quantity:{self.item}": self.quantity}
        value = store.get(key, "unknown")
        if not self.parallel and key == f"price:{self.item}":
            return f"{value}\n[[sim: think]] {self._quantity_call}"
        return f"{value}\n[[sim: think]] {_directive_call('calculator', expression=self.expression)}"

    def calculator(self, expression: str) -> str:
        self.calls.append(("calculator", expression))
        a, b = (int(x) for x in expression.split("*"))
        return f"{a * b}\n[[sim: reply {self.answer}]]"

    def check(self, final: str) -> None:
        assert final.strip() == self.answer
        assert sorted(self.calls[:2]) == [("lookup", f"price:{self.item}"), ("lookup", f"quantity:{self.item}")]
        assert self.calls[2:] == [("calculator", self.expression)]


LOOKUP_DOC = "Look a key (like 'price:apple' or 'quantity:apple') up in the store."
CALC_DOC = "Evaluate a product like '4 * 3'."


# -- the frameworks, each in its own documented loop ---------------------------------------------------------------

def _client(base_url: str, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, **kw)


async def _run_agent(base_url: str, task: Shopping, stream: bool, responses: bool, **client_kw: Any) -> str:
    """openai-agents' own loop, on the Chat Completions model, or with `responses` on its default model: a model name
    resolved by the default provider, which speaks the Responses API."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)

    @function_tool(description_override=LOOKUP_DOC)
    def lookup(key: str) -> str:
        return task.lookup(key)

    @function_tool(description_override=CALC_DOC)
    def calculator(expression: str) -> str:
        return task.calculator(expression)

    client = _client(base_url, **client_kw)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    model = MODEL if responses else OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = Agent(name="shopper", instructions=SYSTEM, model=model, tools=[lookup, calculator],
                  model_settings=ModelSettings(temperature=0.7))
    if not stream:
        result = await Runner.run(agent, task.user, max_turns=6, run_config=config)
        return str(result.final_output)
    streamed = Runner.run_streamed(agent, task.user, max_turns=6, run_config=config)
    deltas = 0
    async for event in streamed.stream_events():
        deltas += event.type == "raw_response_event"
    assert deltas >= 2  # the reply arrived in pieces
    return str(streamed.final_output)


async def run_openai_agents(base_url: str, task: Shopping, stream: bool, **client_kw: Any) -> str:
    return await _run_agent(base_url, task, stream, responses=False, **client_kw)


async def run_openai_agents_responses(base_url: str, task: Shopping, stream: bool) -> str:
    return await _run_agent(base_url, task, stream, responses=True)


async def run_langgraph(base_url: str, task: Shopping, stream: bool) -> str:
    from langchain_core.messages import AIMessageChunk
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool(description=LOOKUP_DOC)
    def lookup(key: str) -> str:
        return task.lookup(key)

    @tool(description=CALC_DOC)
    def calculator(expression: str) -> str:
        return task.calculator(expression)

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", max_retries=0, temperature=0.7,
                     streaming=stream)
    agent = create_react_agent(llm, [lookup, calculator], prompt=SYSTEM)
    inputs = {"messages": [{"role": "user", "content": task.user}]}
    if not stream:
        state = await agent.ainvoke(inputs)
        return str(state["messages"][-1].content)
    chunks = 0
    final = None
    async for mode, payload in agent.astream(inputs, stream_mode=["messages", "values"]):
        if mode == "messages":
            chunks += isinstance(payload[0], AIMessageChunk)
        else:
            final = payload
    assert chunks >= 2 and final is not None
    return str(final["messages"][-1].content)


async def run_pydantic_ai(base_url: str, task: Shopping, stream: bool, client: openai.AsyncOpenAI | None = None) -> str:
    from pydantic_ai import Agent, AgentRunResultEvent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client or _client(base_url)))
    agent = Agent(model, system_prompt=SYSTEM, model_settings={"temperature": 0.7})

    @agent.tool_plain(description=LOOKUP_DOC)
    def lookup(key: str) -> str:
        return task.lookup(key)

    @agent.tool_plain(description=CALC_DOC)
    def calculator(expression: str) -> str:
        return task.calculator(expression)

    if not stream:
        return (await agent.run(task.user)).output
    events = 0
    output = None
    async with agent.run_stream_events(task.user) as stream_events:
        async for event in stream_events:
            events += 1
            if isinstance(event, AgentRunResultEvent):
                output = event.result.output
    assert events > 0 and output is not None
    return output


def _litellm_tools() -> list[dict[str, Any]]:
    def schema(name: str, doc: str, arg: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
            "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    return [schema("lookup", LOOKUP_DOC, "key"), schema("calculator", CALC_DOC, "expression")]


async def run_litellm(base_url: str, task: Shopping, stream: bool, tools: list[dict[str, Any]] | None = None) -> str:
    """litellm has no agent loop of its own; this is the tool loop its documentation shows (append the returned
    message object, then one `tool` message per call), through litellm's OpenAI-compatible provider."""
    import litellm

    litellm.telemetry = False
    tools = tools if tools is not None else _litellm_tools()
    run = {"lookup": task.lookup, "calculator": task.calculator}
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.user}]
    for _ in range(6):
        kwargs = dict(model=f"openai/{MODEL}", api_base=base_url, api_key="unused", messages=messages, tools=tools,
                      temperature=0.7, max_retries=0)
        if stream:
            chunks = [chunk async for chunk in await litellm.acompletion(**kwargs, stream=True)]
            assert len(chunks) >= 2
            response = litellm.stream_chunk_builder(chunks, messages=messages)
        else:
            response = await litellm.acompletion(**kwargs)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": run[call.function.name](**args)})
    raise AssertionError("litellm loop did not finish")


def _json_schema(arg: str) -> dict[str, Any]:
    return {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}


async def _drained(manager: Any, final: str) -> Any:
    """Read an SDK stream helper to its end (the reply must arrive in pieces) and return its final object."""
    events = 0
    async with manager as stream:
        async for _event in stream:
            events += 1
        result = await getattr(stream, final)()
    assert events >= 6
    return result


async def run_openai_responses(base_url: str, task: Shopping, stream: bool, **client_kw: Any) -> str:
    """The official SDK's Responses API in the stateless loop Codex runs: the whole history resent every call, the
    output items echoed as received (reasoning included, as `encrypted_content` too), `function_call_output`s."""
    client = _client(base_url, **client_kw)
    tools = [{"type": "function", "name": "lookup", "description": LOOKUP_DOC, "parameters": _json_schema("key"),
              "strict": False},
             {"type": "function", "name": "calculator", "description": CALC_DOC,
              "parameters": _json_schema("expression"), "strict": False}]
    run = {"lookup": task.lookup, "calculator": task.calculator}
    items: list[Any] = [{"role": "user", "content": task.user}]
    for _ in range(6):
        kwargs: dict[str, Any] = dict(model=MODEL, instructions=SYSTEM, input=items, tools=tools, temperature=0.7,
                                      store=False, include=["reasoning.encrypted_content"])
        if stream:
            response = await _drained(client.responses.stream(**kwargs), "get_final_response")
        else:
            response = await client.responses.create(**kwargs)
        assert response.status == "completed" and response.usage is not None
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": run[call.name](**json.loads(call.arguments))})
    raise AssertionError("responses loop did not finish")


async def run_anthropic(base_url: str, task: Shopping, stream: bool) -> str:
    """The official anthropic SDK in the tool loop its documentation shows: the assistant's content blocks
    appended as received (thinking included), then one user message of `tool_result` blocks."""
    import anthropic

    async with anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key="unused",
                                        max_retries=0) as client:
        return await _anthropic_loop(client, task, stream)


async def _anthropic_loop(client: Any, task: Shopping, stream: bool) -> str:
    tools = [{"name": "lookup", "description": LOOKUP_DOC, "input_schema": _json_schema("key")},
             {"name": "calculator", "description": CALC_DOC, "input_schema": _json_schema("expression")}]
    run = {"lookup": task.lookup, "calculator": task.calculator}
    messages: list[Any] = [{"role": "user", "content": task.user}]
    for _ in range(6):
        kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=1024, system=SYSTEM, messages=messages, tools=tools)
        if stream:
            message = await _drained(client.messages.stream(**kwargs), "get_final_message")
        else:
            message = await client.messages.create(**kwargs)
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                          for block in message.content]})
        uses = [block for block in message.content if block.type == "tool_use"]
        if not uses:
            assert message.stop_reason == "end_turn"
            return "".join(block.text for block in message.content if block.type == "text")
        assert message.stop_reason == "tool_use"
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": run[use.name](**use.input)} for use in uses]})
    raise AssertionError("anthropic loop did not finish")


FRAMEWORKS: dict[str, Callable[..., Awaitable[str]]] = {
    "openai-responses": run_openai_responses,
    "openai-agents-responses": run_openai_agents_responses,
    "anthropic": run_anthropic,
    "openai-agents": run_openai_agents,
    "langgraph": run_langgraph,
    "pydantic-ai": run_pydantic_ai,
    "litellm": run_litellm,
}


# -- fixtures and checks ---------------------------------------------------------------------------------------------

def _stack(stack_factory: StackFactory, family: str, **servers: list[str]) -> contextlib.AbstractContextManager[Stack]:
    # A per-token latency, so a streamed reply reaches the server (and the agent) in many chunks, as from a GPU.
    return stack_factory(family=family, sim_args=["--token-latency-ms", "2"],
                         servers={"server": ["--create-sessions-on-demand"], **servers}, proxied={"server"})


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with _stack(stack_factory, FAMILY, strict=["--message-matcher", "strict"]) as s:
        yield s


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != FAMILY])
def family_stack(request: pytest.FixtureRequest, stack_factory: StackFactory) -> Iterator[Stack]:
    with _stack(stack_factory, request.param) as s:
        yield s


def _is_loopback(host: Any) -> bool:
    if host in (None, "localhost", "", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail the test if any framework tries to reach beyond loopback (telemetry, cost maps, hubs)."""
    attempts: list[str] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def allowed(address: Any) -> bool:
        return not isinstance(address, tuple) or _is_loopback(address[0])

    def connect(self: socket.socket, address: Any) -> None:
        if not allowed(address):
            attempts.append(f"connect {address}")
            raise OSError(101, f"test guard: no traffic beyond loopback ({address})")
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        if not allowed(address):
            attempts.append(f"connect_ex {address}")
            return 101
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_loopback(host):
            attempts.append(f"getaddrinfo {host}")
            raise socket.gaierror(socket.EAI_NONAME, f"test guard: no lookups beyond loopback ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield attempts
    assert not attempts, f"traffic beyond loopback: {attempts}"


def _delete(server: str, sid: str) -> None:
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


# -- the tests ---------------------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # langchain.agents is not a dependency
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_tool_loop_training_data(stack: Stack, framework: str, stream: bool) -> None:
    _tool_loop(stack, framework, stream)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_streaming_tool_loop_on_every_family(family_stack: Stack, framework: str) -> None:
    """Every other family too (its own tool-call and reasoning markup, parsed from streamed deltas)."""
    _tool_loop(family_stack, framework, stream=True)


def _tool_loop(stack: Stack, framework: str, stream: bool) -> None:
    server = stack.server
    sid = new_session(server, {"framework": framework, "stream": stream})
    task = Shopping(parallel=stack.family not in ONE_CALL_PER_REPLY)
    final = asyncio.run(FRAMEWORKS[framework](f"{server}/sessions/{sid}/v1", task, stream))
    task.check(final)
    info = assert_training_data(stack, sid, model_calls=3 if task.parallel else 4, streamed=stream)
    *calling, last = (r["message"] for r in info["records"])
    reasons = stack.family not in (*CHAT_MODE_BY_DEFAULT, *NO_REASONING)
    assert [bool(m.get("reasoning_content")) for m in calling] == [reasons] * len(calling)
    assert [[c["function"]["name"] for c in m["tool_calls"]] for m in calling] == (
        [["lookup"] * 2, ["calculator"]] if task.parallel else [["lookup"], ["lookup"], ["calculator"]])
    assert last["content"] == task.answer and not last.get("tool_calls")
    _delete(server, sid)


def _reorder(value: Any) -> Any:
    """The same JSON value with every object's keys in reverse order: equal in Python, different as text."""
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reorder(v) for v in value]
    return value


def test_two_frameworks_with_differently_ordered_tool_schemas_on_one_server(
    stack: Stack, hf_tokenizers: dict[str, Any]
) -> None:
    """openai-agents sends its tool schemas; litellm then sends the very same schemas with every key order reversed
    (equal as values). Before rendered-tools caching was keyed on what is rendered, the second client's next turn
    got the first client's cached prefix: a 400 template_error. Each session must render its own text."""
    server = stack.server
    sent: list[dict[str, Any]] = []

    async def capture(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    a = new_session(server, {"framework": "openai-agents"})
    task_a = Shopping()
    http_client = httpx.AsyncClient(event_hooks={"request": [capture]})
    final = asyncio.run(run_openai_agents(f"{server}/sessions/{a}/v1", task_a, False, http_client=http_client))
    task_a.check(final)
    agents_tools = sent[0]["tools"]
    reordered = _reorder(copy.deepcopy(agents_tools))
    assert reordered == agents_tools and json.dumps(reordered) != json.dumps(agents_tools)

    b = new_session(server, {"framework": "litellm"})
    task_b = Shopping(item="pear", price=7, quantity=5)
    task_b.check(asyncio.run(run_litellm(f"{server}/sessions/{b}/v1", task_b, False, tools=reordered)))
    tokenizer = hf_tokenizers[stack.family]
    for sid, tools in ((a, agents_tools), (b, reordered)):
        info = assert_training_data(stack, sid, model_calls=3)
        prompt = tokenizer.decode(info["token_ids"][: info["records"][0]["prompt_len"]])
        assert all(json.dumps(t, ensure_ascii=False) in prompt for t in tools)  # each rendered in its own order
        _delete(server, sid)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_concurrent_episodes_over_one_base_url(stack: Stack, stream: bool) -> None:
    """verifiers-style: ONE client for the whole run at the root URL, one X-Session-ID per rollout, rollouts
    concurrent; sessions are created on first use. Every episode gets its own trajectory: no interleaving."""
    server = stack.server
    items = ("apple", "pear", "plum", "fig")
    tasks = {f"rollout-{stream:d}-{i}": Shopping(item=item, price=2 + i, quantity=3 + i)
             for i, item in enumerate(items)}

    async def rollout(client: openai.AsyncOpenAI, sid: str, task: Shopping) -> str:
        tools = _litellm_tools()
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.user}]
        run = {"lookup": task.lookup, "calculator": task.calculator}
        for _ in range(6):
            kwargs: dict[str, Any] = dict(model=MODEL, messages=messages, tools=tools,
                                          extra_headers={"X-Session-ID": sid})
            if stream:
                message = await _streamed_message(client, kwargs)
            else:
                message = (await client.chat.completions.create(**kwargs)).choices[0].message.model_dump(
                    exclude_none=True)
            messages.append(message)
            if not message.get("tool_calls"):
                return str(message["content"])
            for call in message["tool_calls"]:
                result = run[call["function"]["name"]](**json.loads(call["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        raise AssertionError("rollout did not finish")

    async def main() -> list[str]:
        client = _client(f"{server}/v1")  # one client, one base URL, for every rollout
        return await asyncio.gather(*(rollout(client, sid, task) for sid, task in tasks.items()))

    for final, task in zip(asyncio.run(main()), tasks.values(), strict=True):
        task.check(final)
    for sid, task in tasks.items():
        info = assert_training_data(stack, sid, model_calls=3, streamed=stream)
        assert info["session_id"] == sid
        text = json.dumps(info["messages"])
        assert task.item in text and not any(other in text for other in items if other != task.item)
        _delete(server, sid)


async def _streamed_message(client: openai.AsyncOpenAI, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Assemble an assistant message from OpenAI stream chunks (content, reasoning and tool-call deltas by index)."""
    content, reasoning = [], []
    calls: dict[int, dict[str, Any]] = {}
    stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    return message


def test_a_framework_that_reserialises_arguments_rolls_back_visibly_under_strict(stack: Stack) -> None:
    """pydantic-ai echoes tool-call arguments compacted. The default matcher keeps every turn (the tool loop test);
    under `--message-matcher strict` each echo rolls the previous turn back -- and that is never silent: the reply
    header, the metric by reason and the session's records all say so."""
    strict = stack["strict"]
    replies: list[httpx.Response] = []

    async def keep(response: httpx.Response) -> None:
        replies.append(response)

    rollbacks = 'session_server_rollbacks_total{reason="tool_call_arguments"}'
    before = metric(strict, rollbacks)
    sid = new_session(strict, {"framework": "pydantic-ai", "matcher": "strict"})
    task = Shopping()
    client = _client(f"{strict}/sessions/{sid}/v1", http_client=httpx.AsyncClient(event_hooks={"response": [keep]}))
    task.check(asyncio.run(run_pydantic_ai(f"{strict}/sessions/{sid}/v1", task, False, client=client)))
    assert [r.headers.get("x-session-rollback") for r in replies] == [
        None, "1; reason=tool_call_arguments", "1; reason=tool_call_arguments"]
    assert metric(strict, rollbacks) == before + 2
    info = httpx.get(f"{strict}/sessions/{sid}").json()
    assert info["rollbacks"] == 2 and info["rollbacks_by_reason"] == {"tool_call_arguments": 2}
    assert len(info["records"]) == 1 and info["records"][0]["rollback_reason"] == "tool_call_arguments"
    _delete(strict, sid)
