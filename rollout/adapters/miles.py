"""miles: a custom generate function that points miles' agentic flow at our (external) session server.

miles speaks our wire (its `--use-session-server` is the reference our server is compatible with), but it always
starts its own session server, and its `generate_hub.agentic_tool_call.generate` takes the server from
`args.session_server_ip` / `args.session_server_ports`. This module is the same generate function for a server that
runs elsewhere: `--custom-generate-function-path rollout.adapters.miles.generate` with `--custom-agent-function-path`
(miles' agent contract, unchanged: `base_url` is the session root, the agent appends `/v1`) and the servers in
`args.session_servers` (or `ROLLOUT_SESSION_SERVERS`, comma-separated).

Field for field the samples are slime's (rollout.adapters.slime `to_samples`, miles' `miles/utils/types.py` keeps
slime's fields), with `rollout_routed_experts` as miles' int32 numpy array [len(tokens) - 1, layers, top_k]
(`--num-layers`), every segment sharing the input's `rollout_id` as miles' v2 path sets it, and the agent's returned
dict merged into each sample's metadata as miles' v1 path does. The same as slime's too: sampling masks as
`rollout_top_p_token_ids` / `rollout_top_p_token_offsets` (miles' sampling-support replay, int32 numpy), a forked
session's `lineage` and a LoRA-sampled one's `adapter_revisions` (one per engine call) in `metadata`, and an episode
the infrastructure ended as ABORTED with `remove_sample = True`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

from rollout.adapters._common import load_function, request_kwargs, run_session
from rollout.adapters.slime import to_samples
from trajectory import Sample


def to_miles_samples(samples: Sequence[Sample], base: Any, *, reward: Any = None, rollout_id: int | None = None,
                     expert_layers: int | None = None, metadata: dict[str, Any] | None = None) -> list[Any]:
    """Copies of miles' input sample, one per segment (see rollout.adapters.slime `to_samples`)."""
    return to_samples(samples, base, reward=reward, rollout_id=rollout_id, expert_layers=expert_layers,
                      experts_as="numpy", metadata=metadata)


def _servers(args: Any) -> list[str]:
    servers = getattr(args, "session_servers", None) or os.environ.get("ROLLOUT_SESSION_SERVERS", "").split(",")
    servers = [s for s in servers if s]
    if not servers:
        raise ValueError("no session server: set args.session_servers or ROLLOUT_SESSION_SERVERS")
    return servers


async def generate(input: Any) -> Any:
    """miles' generate function (`GenerateFnInput` -> `GenerateFnOutput`): one session on our server, collected."""
    from miles.rollout.base_types import GenerateFnOutput

    args, sample = input.args, input.sample
    agent = load_function(args.custom_agent_function_path)
    max_seq_len = getattr(args, "max_seq_len", None)
    from rollout.client import SessionClient

    async with SessionClient(_servers(args)) as client:
        episode = await run_session(client, agent, prompt=sample.prompt, request=request_kwargs(input.sampling_params),
                                    metadata=dict(sample.metadata or {}), max_seq_len=max_seq_len,
                                    base_url_suffix="")
    if not episode.samples:
        failed = copy.deepcopy(sample)
        failed.status = type(sample).Status.ABORTED
        return GenerateFnOutput(samples=[failed])
    layers = getattr(args, "num_layers", None) if any(s.routed_experts is not None for s in episode.samples) else None
    return GenerateFnOutput(samples=to_miles_samples(episode.samples, sample, reward=episode.reward,
                                                     expert_layers=layers, metadata=episode.metadata))
