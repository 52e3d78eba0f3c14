"""The agents the adapter tests run, in miles' agent-function contract (`base_url, prompt, request_kwargs,
metadata -> reward`): the official openai SDK against one session of a real session server in front of sglang-sim.

`tool_agent`: three turns, two tool calls whose results are fed back, then a reply; the engine's weight version is
set to "5" before the first turn and to "7" before the last, so the sample's tokens carry two versions.
`compacting_agent`: five turns whose history is compacted before the fourth, so the session has two segments.
`responses_agent`: `tool_agent`'s episode over the Responses API, keeping each call's output items (NeMo Gym).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from sglang_sim.directives import reply, tokens, tool_call

LAYERS, TOP_K = 2, 2  # the sim's routed experts per token
ENGINE: dict[str, str] = {}  # "url": the sim, set by the tests' stack fixture
REWARD = 0.75
SYSTEM = {"role": "system", "content": "You are a coding agent."}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": "run", "parameters": {"type": "object"}}]
OUTPUTS: dict[str, list[list[dict[str, Any]]]] = {}  # responses_agent: session base URL -> each call's output items
SERVER_FIELDS: dict[str, list[dict[str, Any]]] = {}  # responses_agent: base URL -> each reply's token fields
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")


def _sdk(base_url: str) -> openai.AsyncOpenAI:
    url = base_url if base_url.endswith("/v1") else f"{base_url}/v1"  # miles' agents get the session root
    return openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)


async def set_version(version: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{ENGINE['url']}/update_weight_version",
                            json={"new_version": version, "abort_all_requests": False})
        r.raise_for_status()


def _tool_result(k: int, call_id: str) -> dict[str, Any]:
    nxt = tool_call("run", cmd=f"step {k}") if k == 0 else reply("All done.")
    return {"role": "tool", "tool_call_id": call_id, "content": f"output {k} {tokens(3)} {nxt}"}


async def tool_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> float:
    client = _sdk(base_url)
    messages: list[Any] = [SYSTEM, {"role": "user", "content": f"{prompt or 'fix it'} {tool_call('run', cmd='ls')}"}]
    for k in range(3):
        await set_version("5" if k == 0 else "7" if k == 2 else "5")
        completion = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                          **request_kwargs)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            messages.append(_tool_result(k, message.tool_calls[0].id))
    await client.close()
    return REWARD


async def compacting_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                           metadata: dict[str, Any]) -> dict[str, Any]:
    client = _sdk(base_url)
    await set_version("5")
    messages: list[Any] = [SYSTEM, {"role": "user", "content": f"fix it {tool_call('run', cmd='ls')}"}]
    for k in range(5):
        if k == 3:  # the harness compacts: its history becomes the system prompt and a summary
            messages = [SYSTEM, {"role": "user", "content": "Summary: listed, built and tested. Continue. "
                                                            f"{tool_call('run', cmd='ship')}"}]
        completion = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                          **request_kwargs)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            nxt = tool_call("run", cmd=f"step {k}") if k < 2 else reply("All done.")
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                             "content": f"output {k} {nxt}"})
        else:
            messages.append({"role": "user", "content": f"go on {tokens(4)}"})
    await client.close()
    return {"reward": REWARD, "agent_turns": 5}


async def responses_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                          metadata: dict[str, Any]) -> float:
    client = _sdk(base_url)
    outputs: list[list[dict[str, Any]]] = []
    items: list[Any] = [{"role": "system", "content": SYSTEM["content"]},
                        {"role": "user", "content": f"fix it {tool_call('run', cmd='ls')}"}]
    for k in range(3):
        await set_version("5" if k < 2 else "7")
        response = await client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS,
                                                 extra_body={"return_token_ids": True})
        output = [item.model_dump(exclude_none=True) for item in response.output]
        # the server's own token fields on the last item (its return_token_ids), kept apart from the plain items
        SERVER_FIELDS.setdefault(base_url, []).append({k: output[-1].pop(k) for k in TOKEN_FIELDS if k in output[-1]})
        outputs.append(output)
        items += output
        calls = [item for item in output if item["type"] == "function_call"]
        if calls:
            items.append({"type": "function_call_output", "call_id": calls[0]["call_id"],
                          "output": _tool_result(k, calls[0]["call_id"])["content"]})
    OUTPUTS[base_url] = outputs
    await client.close()
    return REWARD


async def short_tool_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                           metadata: dict[str, Any]) -> float:
    """Two turns: a tool call whose result is fed back, then a reply (TRL's rows; no version change of its own)."""
    client = _sdk(base_url)
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    messages: list[Any] = [SYSTEM, {"role": "user", "content": f"{text} {tool_call('run', cmd='ls')}"}]
    completion = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **request_kwargs)
    message = completion.choices[0].message
    assert message.tool_calls
    messages += [message.model_dump(exclude_none=True), _tool_result(1, message.tool_calls[0].id)]
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **request_kwargs)
    await client.close()
    return REWARD


async def straddling_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                           metadata: dict[str, Any]) -> float:
    """One long reply (1500 tokens, 15 s at the engine) whose weights change to "9" after its first 20 tokens, so one
    turn's tokens carry two versions ("5" then "9"). `metadata["engine"]`: the sim of this session's server."""
    from support.server import wait_emitted

    engine = metadata["engine"]
    async with httpx.AsyncClient(timeout=30) as http:
        (await http.post(f"{engine}/update_weight_version", json={"new_version": "5"})).raise_for_status()
        client = _sdk(base_url)
        reply_task = asyncio.ensure_future(client.chat.completions.create(
            model="m", messages=[SYSTEM, {"role": "user", "content": f"write {tokens(1500)}"}], max_tokens=1600))
        await asyncio.to_thread(wait_emitted, engine, 20)
        (await http.post(f"{engine}/update_weight_version",
                         json={"new_version": "9", "abort_all_requests": False})).raise_for_status()
        await reply_task
    await client.close()
    return REWARD


async def failing_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                        metadata: dict[str, Any]) -> float:
    """One turn, then the engine answers 500 to the next (the sim's fault injection): the agent gives up with the
    SDK's error, as an agent does when the infrastructure fails it (rollout/infrastructure.py)."""
    client = _sdk(base_url)
    messages: list[Any] = [SYSTEM, {"role": "user", "content": f"hello {tokens(4)}"}]
    completion = await client.chat.completions.create(model="m", messages=messages, **request_kwargs)
    messages += [completion.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    async with httpx.AsyncClient(timeout=30) as http:
        (await http.post(f"{ENGINE['url']}/sim/faults", json={"http_500": 1.0})).raise_for_status()
        try:
            await client.chat.completions.create(model="m", messages=messages, **request_kwargs)
        finally:
            (await http.post(f"{ENGINE['url']}/sim/faults", json={})).raise_for_status()
            await client.close()
    return REWARD
