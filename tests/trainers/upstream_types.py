"""The seam types of slime and miles, which are not on PyPI (PyPI's "slime" is an unrelated project), written here
from their published source as facts: only the type definitions the adapters fill, same field names, types, defaults
and `Status` values, nothing else of either project.

- slime v0.3.1 (THUDM/slime a6272da0d4f3d0a08520c99a2f3b4f6c887960dc), `slime/utils/types.py` `Sample`: `loss_mask`
  and `rollout_log_probs` cover the response only (its `_validate_response_metadata_lengths`),
  `rollout_routed_experts` is a tensor [len(tokens) - 1, num_layers, moe_router_topk], `weight_versions` one per
  engine call, `rollout_id` shared by the samples split from one rollout.
- miles (radixark/miles 31f1ca961a94cb860cec3b2dea34ec332bfa8f76), `miles/utils/types.py` `Sample` (slime's fields,
  `rollout_routed_experts` an int32 numpy array, the dtype its samples wire insists on) and
  `miles/rollout/base_types.py` `GenerateFnInput` / `GenerateFnOutput`.

`install()` registers them as `slime.utils.types`, `miles.utils.types` and `miles.rollout.base_types`, the modules
the adapters (and a user's slime or miles process) import them from.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class SlimeSample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None  # list[list[int]] | torch.Tensor | None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    Status = Status
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None

    def validate_lengths(self) -> None:
        """slime's own check after every append: the response-side arrays are `response_length` long."""
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError("rollout_log_probs length != response_length")


@dataclass
class MilesSample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None  # numpy int32 (num_tokens - 1, num_layers, moe_router_topk)
    rollout_indexer_topk: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None
    Status = Status
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    non_generation_time: float = 0.0


@dataclass(frozen=True)
class GenerateFnInput:
    state: Any  # miles' GenerateState; `args` is read from it
    sample: MilesSample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: MilesSample | list[MilesSample]


def install() -> None:
    def module(name: str, **members: Any) -> None:
        mod = types.ModuleType(name)
        mod.__dict__.update(members)
        sys.modules[name] = mod

    for name in ("slime", "slime.utils", "miles", "miles.utils", "miles.rollout"):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = []
            sys.modules[name] = pkg
    module("slime.utils.types", Sample=SlimeSample)
    module("miles.utils.types", Sample=MilesSample)
    module("miles.rollout.base_types", GenerateFnInput=GenerateFnInput, GenerateFnOutput=GenerateFnOutput)
