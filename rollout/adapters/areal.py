"""AReaL: our samples as the tensor dict `RolloutWorkflow.arun_episode` returns, and a workflow that runs on our server.

AReaL's seam (`areal/api/workflow_api.py`) is `RolloutWorkflow.arun_episode(engine, data)`, returning a dict of
tensors with a batch dimension (its own `multi_turn.py` builds exactly these keys). Field for field, one row per
segment of the session, right-padded by AReaL's own `concat_padded_tensors`:

- `input_ids` int32 [B, L]: the sample's tokens; `attention_mask` bool: 1 on real tokens;
- `loss_mask` int32: 1 on sampled tokens, 0 on the prompt, tool output and glue; `logprobs` float32: the rollout
  logprobs (0.0 where the mask is 0);
- `versions` int32: the integer weight version that sampled each token, -1 elsewhere (AReaL's convention);
- `rewards` float32 [B]: the episode's reward on every row.

With sampling masks (AReaL 1.0.4 has no field for them: extras, as lists AReaL's `concat_padded_tensors` concatenates
without padding): `sampling_mask_ids` (int32) and `sampling_mask_offsets` (int64, `len(tokens) + 1`), one CSR per
row over its tokens as the sample holds it (empty rows where nothing was sampled), and `sampling_logprobs` float32
[B, L] (the engine's logprob of each sampled token over its row). With `lineage=True`, `lineage`: one entry per row.
With `adapters=True`, `adapter_revisions`: one list per row, per token the LoRA adapter revision that sampled it,
`NAME@REVISION` ("" the base model, None where nothing was sampled; AReaL 1.0.4 has no field for it, and its tensor
`versions` stays the weight version). A flag, not automatic: AReaL concatenates only trajectories with the same keys.

An episode the infrastructure ended (status "aborted", trajectory/infrastructure.py) is AReaL's rejected trajectory:
`SessionWorkflow.arun_episode` returns None, so it is not trained on and scores nothing.

AReaL 1.0.4 carries no routed experts into its training batch (only `ModelResponse.routed_experts`), so none are
added. The `engine` AReaL hands the workflow is not used: the session server talks to SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollout.adapters._common import (
    Agent,
    load_function,
    request_kwargs,
    require_samples,
    run_session,
    token_adapter_labels,
)
from trajectory import Sample, parse_version, sample_metadata


def to_tensor_dict(samples: Sequence[Sample], *, reward: float | None = None,
                   version_of: Callable[[str], int] = parse_version, lineage: bool = False,
                   adapters: bool = False) -> dict[str, Any]:
    """One session's samples as AReaL's trajectory dict: a row per segment, padded to one length.

    `lineage`: add the `lineage` key (a list, one entry per row; None for a session that was not forked), on every
    episode of a run alike (AReaL concatenates only dicts with the same keys); `adapters`: add `adapter_revisions`
    (a list, one per-token list per row) the same way."""
    import torch
    from areal.utils.data import concat_padded_tensors

    rows = []
    for sample in samples:
        n = len(sample.tokens)
        extras: dict[str, Any] = {}
        if (masks := sample.sampling_masks) is not None:  # lists, one entry per row: concatenated, never padded
            extras = {"sampling_mask_ids": [masks.ids.copy()], "sampling_mask_offsets": [masks.offsets.copy()],
                      "sampling_logprobs": torch.from_numpy(masks.logprobs.copy()).unsqueeze(0)}
        if lineage:
            extras["lineage"] = [sample.metadata.get("lineage")]
        if adapters:
            extras["adapter_revisions"] = [token_adapter_labels(sample)]
        rows.append({
            "input_ids": torch.from_numpy(sample.tokens.copy()).to(torch.int32).unsqueeze(0),
            "loss_mask": torch.from_numpy(sample.loss_mask.astype("int32")).unsqueeze(0),
            "logprobs": torch.from_numpy(sample.rollout_log_probs.copy()).unsqueeze(0),
            "versions": torch.from_numpy(sample_metadata(sample).version_ids(version_of)).to(torch.int32).unsqueeze(0),
            "attention_mask": torch.ones(n, dtype=torch.bool).unsqueeze(0),
            "rewards": torch.tensor([float(reward or 0.0)], dtype=torch.float32),
            **extras,
        })
    result: dict[str, Any] = concat_padded_tensors(rows)
    return result


def _workflow_class() -> type:
    from areal.api.workflow_api import RolloutWorkflow

    class SessionWorkflow(RolloutWorkflow):  # type: ignore[misc]
        """Runs each episode as one session on our servers; `data` goes to the agent as the prompt (its "messages"
        when it has them) and as metadata."""

        def __init__(self, servers: str | Sequence[str], agent: str | Agent, *, max_seq_len: int | None = None,
                     sampling_params: dict[str, Any] | None = None,
                     version_of: Callable[[str], int] = parse_version, lineage: bool = False,
                     adapters: bool = False) -> None:
            self.servers = [servers] if isinstance(servers, str) else list(servers)
            self.lineage = lineage
            self.adapters = adapters
            self.agent = load_function(agent)
            self.max_seq_len = max_seq_len
            self.request = request_kwargs(sampling_params)
            self.version_of = version_of

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
            from rollout.client import SessionClient

            async with SessionClient(self.servers) as client:
                episode = await run_session(
                    client, self.agent, prompt=data.get("messages", data), request=self.request,
                    metadata={k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))},
                    max_seq_len=self.max_seq_len)
            if not episode.samples or episode.aborted:
                # AReaL's "rejected": the agent made no model call, or the infrastructure ended the episode
                return None
            require_samples(episode.samples)
            return to_tensor_dict(episode.samples, reward=episode.reward, version_of=self.version_of,
                                  lineage=self.lineage, adapters=self.adapters)

    SessionWorkflow.__module__ = __name__
    return SessionWorkflow


def __getattr__(name: str) -> Any:
    if name == "SessionWorkflow":
        cls = _workflow_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
