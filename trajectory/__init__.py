"""Pure trajectory core: model families, TITO prompt building, linear trajectories, engine-output validation, samples.

No I/O and no asyncio here: everything is a function of its inputs, so it is tested with hypothesis directly.
Token ids (and logprobs) are stored exactly as the engine sampled them: they are what is trained on. The stored
assistant message is parsed from the engine's `text`, which is what the agent is shown (families/base.py says why).
One turn, as the server drives it::

    family = get_family("qwen3", AutoTokenizer.from_pretrained(path))    # loading is the caller's I/O
    traj = LinearTrajectory(family, max_rollback=1, matcher="strict")
    plan = traj.prepare(request["messages"], request.get("tools"))       # pure; may raise 400s
    result = decode_generate_response(engine_body, family.vocab_size)    # strict; raises UpstreamError (502)
    reply = family.parse_completion(result.text).to_message(f"call_{rid}")   # what the agent is shown
    record = traj.commit(plan, result, reply)                            # atomic; InvariantError (500)

A session whose history is not one line (compaction, sub-agents, side requests) is a `SegmentSet` of such
trajectories (session_segments.py): the same prepare/commit, with the segment chosen by the request's messages.
"""

from . import errors
from .continuation import continuable_abort, join_results
from .engine_output import GenerateResult, decode_generate_response
from .families import ModelFamily, ParsedCompletion, ToolCall, family_names, get_family, register_family
from .infrastructure import InfrastructureAbort, abort_samples, infrastructure_abort
from .linear import Checkpoint, LinearTrajectory, TurnPlan, TurnRecord
from .messages import MATCHER_NAMES, MessageMatcher, normalize_messages, normalize_tools
from .sample_metadata import INITIAL_VERSION, GeneratedTurn, SampleMetadata, parse_version, sample_metadata
from .samples import (
    Sample,
    build_merged_sample,
    build_segment_samples,
    build_turn_samples,
    samples_from_json,
    samples_from_safetensors,
    samples_to_json,
    samples_to_safetensors,
    truncate_sample,
)
from .session_segments import Segment, SegmentPlan, SegmentSet

__all__ = [
    "INITIAL_VERSION",
    "MATCHER_NAMES",
    "Checkpoint",
    "GenerateResult",
    "GeneratedTurn",
    "InfrastructureAbort",
    "LinearTrajectory",
    "MessageMatcher",
    "ModelFamily",
    "ParsedCompletion",
    "Sample",
    "SampleMetadata",
    "Segment",
    "SegmentPlan",
    "SegmentSet",
    "ToolCall",
    "TurnPlan",
    "TurnRecord",
    "abort_samples",
    "build_merged_sample",
    "build_segment_samples",
    "build_turn_samples",
    "continuable_abort",
    "decode_generate_response",
    "errors",
    "family_names",
    "get_family",
    "infrastructure_abort",
    "join_results",
    "normalize_messages",
    "normalize_tools",
    "parse_version",
    "register_family",
    "sample_metadata",
    "samples_from_json",
    "samples_from_safetensors",
    "samples_to_json",
    "samples_to_safetensors",
    "truncate_sample",
]
