"""A stand-in for slime's `Sample` in the unit tier (slime is not on PyPI; tests/trainers/upstream_types.py has the
real field list): the fields rollout.adapters.slime `to_samples` writes, and its `Status` values."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


@dataclass
class SlimeSample:
    Status = Status
    index: int = 0
    rollout_id: int | None = None
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Any = None
    reward: Any = None
    remove_sample: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_routed_experts: Any = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
