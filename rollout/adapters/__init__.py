"""One adapter per trainer seam: our samples in the trainer's own types, field for field.

| module | seam | what it builds |
|---|---|---|
| `rollout.adapters.verl` | verl 0.9 `AgentLoopBase.run` | `AgentLoopOutput` per segment (`SessionAgentLoop`) |
| `rollout.adapters.skyrl` | SkyRL `GeneratorInterface.generate` | `GeneratorOutput` (`SessionGenerator`) |
| `rollout.adapters.areal` | AReaL `RolloutWorkflow.arun_episode` | the padded tensor dict (`SessionWorkflow`) |
| `rollout.adapters.slime` | slime `--custom-generate-function-path` | slime `Sample`s sharing a `rollout_id` |
| `rollout.adapters.miles` | miles `--custom-generate-function-path` | miles `Sample`s, its agent functions unchanged |
| `rollout.adapters.trl` | TRL `GRPOTrainer(rollout_func=...)` | the rollout dict, weights pushed into SGLang |
| `rollout.adapters.nemo_gym` | NeMo Gym Responses output items | the token fields of each model call |

Each module imports its trainer only inside its functions (or on first use of its seam class), so `import rollout`
and `import rollout.adapters` need no trainer installed; docs/adapters.md has an example per trainer.
"""

from __future__ import annotations

from rollout.adapters._common import (
    Agent,
    SessionEpisode,
    prompt_length,
    request_kwargs,
    response_part,
    run_session,
)

__all__ = [
    "Agent",
    "SessionEpisode",
    "prompt_length",
    "request_kwargs",
    "response_part",
    "run_session",
]
