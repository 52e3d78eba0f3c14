"""The trainer's side: session client, agent-episode driver, torch batches.

Exports are resolved lazily: `import rollout` imports neither `openai` nor torch; `rollout.to_torch_batch` and
`rollout.check_logprobs` import torch on first use.

```python
from rollout import AgentConfig, SessionClient, Task, run_episodes, to_torch_batch
```
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SessionClient": "rollout.client",
    "RolloutError": "rollout.errors",
    "ServerConnectionError": "rollout.errors",
    "SessionServerError": "rollout.errors",
    "SessionNotFoundError": "rollout.errors",
    "ServerBusyError": "rollout.errors",
    "UnknownSessionError": "rollout.errors",
    "AgentConfig": "rollout.episodes",
    "EpisodeResult": "rollout.episodes",
    "Task": "rollout.episodes",
    "iter_episodes": "rollout.episodes",
    "run_episode": "rollout.episodes",
    "run_episodes": "rollout.episodes",
    "run_group": "rollout.episodes",
    "Tool": "rollout.tools",
    "ToolCall": "rollout.tools",
    "Toolbox": "rollout.tools",
    "default_toolbox": "rollout.tools",
    "to_torch_batch": "rollout.torch_batch",
    "PrefixBatch": "rollout.prefix_tree",
    "dedupe_prefixes": "rollout.prefix_tree",
    "LogprobCheckReport": "rollout.logprob_check",
    "SampleCheck": "rollout.logprob_check",
    "TokenMismatch": "rollout.logprob_check",
    "check_logprobs": "rollout.logprob_check",
}

__all__ = [
    "AgentConfig",
    "EpisodeResult",
    "LogprobCheckReport",
    "PrefixBatch",
    "RolloutError",
    "SampleCheck",
    "ServerBusyError",
    "ServerConnectionError",
    "SessionClient",
    "SessionNotFoundError",
    "SessionServerError",
    "Task",
    "TokenMismatch",
    "Tool",
    "ToolCall",
    "Toolbox",
    "UnknownSessionError",
    "check_logprobs",
    "dedupe_prefixes",
    "default_toolbox",
    "iter_episodes",
    "run_episode",
    "run_episodes",
    "run_group",
    "to_torch_batch",
]

if TYPE_CHECKING:
    from rollout.client import SessionClient
    from rollout.episodes import (
        AgentConfig,
        EpisodeResult,
        Task,
        iter_episodes,
        run_episode,
        run_episodes,
        run_group,
    )
    from rollout.errors import (
        RolloutError,
        ServerBusyError,
        ServerConnectionError,
        SessionNotFoundError,
        SessionServerError,
        UnknownSessionError,
    )
    from rollout.logprob_check import LogprobCheckReport, SampleCheck, TokenMismatch, check_logprobs
    from rollout.prefix_tree import PrefixBatch, dedupe_prefixes
    from rollout.tools import Tool, Toolbox, ToolCall, default_toolbox
    from rollout.torch_batch import to_torch_batch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
