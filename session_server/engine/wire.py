"""The engine's side of a turn: the SGLang /generate body we send and the strict decode of what comes back.

Pure functions of their arguments (they run on the CPU pool or inline, by size). The body follows docs/design.md 5.1 and
the released SGLang source; the decode enforces docs/design.md 5.3 (trajectory.decode_generate_response) after cutting
the routed-experts payload out of the raw bytes, so megabytes of replay data are never parsed on the hot path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from trajectory import GenerateResult, decode_generate_response
from trajectory.errors import UpstreamError
from trajectory.images import Image, collapse

# Sampling keys of constrained decoding (docs/design.md 5.1): each installs a grammar on the engine's request.
CONSTRAINED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """One /generate request of docs/design.md 5.1, as data: what the turn asks of the engine, built in one place
    (turns/engine_call.py) and encoded in one (`encode_generate`). A new engine knob is one field here and one line
    there.

    `start` > 0 sends only the tokens an engine session does not hold; `stream_interval`: tokens per stream event
    (engine/pacing.py), sent for a streamed request only.

    `thinking`: the turn is in thinking mode (`ModelFamily.thinking_mode`). SGLang's chat server then sends
    `require_reasoning: true`, and an engine run with `--reasoning-parser` holds a grammar back until the reasoning
    ends (ReasonerGrammarBackend), so the model thinks before a forced tool call or a JSON answer. We send it where
    it has that effect, with a grammar: without one the flag only changes the engine's reasoning-token count.

    `images`: every image of the prompt in order (trajectory/images.py). The engine gets each stored run of
    `image_pad` ids collapsed to one pad and `image_data` with all of them, on every turn: SGLang expands the pads
    itself (a pre-expanded run is a 500 in 0.5.23) and keys its radix cache by image content, so earlier images are
    neither re-sent as runs nor re-computed. A prompt with images is sent whole (`start` 0: no engine session).
    """

    input_ids: Any  # the whole prompt, int32 (numpy or a list)
    sampling_params: dict[str, Any]
    rid: str  # our own id, so we can abort it by exact match
    start: int = 0
    session_params: dict[str, Any] | None = None
    stream: bool = False
    stream_interval: int | None = None
    top_logprobs: int = 0  # top_logprobs_num
    routed_experts: bool = False
    routed_experts_start: int = 0  # routed_experts_start_len: the first position the trajectory does not hold
    thinking: bool = False
    images: Sequence[Image] = ()
    image_pad: int = -1
    # Ask for the ids the sampler kept per output token and the sampled token's logprob over them (SGLang's
    # `return_sampling_mask`, mode "selected"; trajectory/sampling_masks.py).
    sampling_masks: bool = False
    # SGLang's `extra_key`: the radix-cache namespace, derived from the weight version the request is meant for
    # (engine/versions.py), so no prefix computed by other weights is reused. None sends none.
    extra_key: str | None = None
    # SGLang's `lora_path`: the engine name of the LoRA adapter revision the session is pinned to (engine/adapters.py);
    # None: the base model.
    lora_path: str | None = None
    # `input_ids` as a JSON array, encoded once for many requests (TurnPlan.wire_ids); used when the whole prompt is
    # sent as it is (no images, no engine session's `start`).
    input_json: bytes | None = None

    @property
    def size(self) -> int:
        """About how many bytes encoding costs: what picks the CPU pool over running inline."""
        return 4 * (len(self.input_ids) - self.start) + sum(len(image.data) for image in self.images)


def encode_generate(request: GenerateRequest) -> bytes:
    """The /generate body of `request` (docs/design.md 5.1).

    orjson writes the int32 id array straight from numpy: the prompt is the one part of the body that grows with the
    history, and going through a Python list first costs ~5x more per token.
    """
    sp = request.sampling_params
    if request.stream and request.stream_interval is not None:
        sp = {**sp, "stream_interval": request.stream_interval}
    images = request.images
    encoded = request.input_json if not images and not request.start else None
    payload: dict[str, Any] = {
        "input_ids": orjson.Fragment(encoded) if encoded is not None else collapse(request.input_ids, request.image_pad)
        if images else request.input_ids[request.start:],
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": request.rid,
        "stream": request.stream,
    }
    if images:
        payload["image_data"] = [image.data_url() for image in images]
    if request.session_params is not None:
        payload["session_params"] = request.session_params
    if request.routed_experts:
        payload["return_routed_experts"] = True
        # Positions [routed_experts_start, ...) only: earlier ones are in the trajectory's records already (the
        # engine would otherwise resend the whole prompt's routing every turn: quadratic over a trajectory).
        payload["routed_experts_start_len"] = request.routed_experts_start
    if request.top_logprobs > 0:
        payload["top_logprobs_num"] = request.top_logprobs
    if request.extra_key is not None:
        payload["extra_key"] = request.extra_key
    if request.lora_path is not None:
        payload["lora_path"] = request.lora_path
    if request.thinking and any(sp.get(key) is not None for key in CONSTRAINED_KEYS):
        payload["require_reasoning"] = True
    if request.sampling_masks:
        payload["return_sampling_mask"] = True
        payload["sampling_logprobs_mode"] = "selected"
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_ids(ids: Any) -> bytes:
    """Prompt ids as the JSON array `encode_generate` writes (GenerateRequest.input_json)."""
    return orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)


_ROUTED_KEY = b'"routed_experts":'
_JSON_SPACE = b" \t\r\n"


def split_routed_experts(body: bytes) -> tuple[bytes, memoryview | None]:
    """Cut the routed-experts payload out of an engine body before decoding it, as raw bytes.

    Released SGLang sends a base64 string (int32 [rows, layers, top_k]); base64 holds no `"` or `\\`, so the string
    ends at the next quote and the cut is two memchr calls. The legacy nested-list shape is cut as below.

    Why: the payload is megabytes of nested integer arrays that the server only stores for replay. Even msgspec's
    Raw type has to scan it to find where it ends (about 3-4 ms for 1.5 MiB here, holding the GIL), while the end of
    an array of numbers is simply the first `"` or `}` after it (numbers and brackets contain neither), which
    bytes.find locates at memchr speed. The key cannot be forged by generated text: inside a JSON string its
    quotes would be escaped. Anything that does not look like such an array is left in the body for the full
    decoder. If an odd payload (say, strings inside the array) made the cut land inside it, the rest has unbalanced
    brackets and fails to decode, and decode_turn then decodes the whole body instead: the cut never changes a verdict.
    The payload itself is not validated (it is stored for replay, never interpreted here).
    """
    at = body.find(_ROUTED_KEY)
    if at < 0:
        return body, None
    start = at + len(_ROUTED_KEY)
    while start < len(body) and body[start] in _JSON_SPACE:
        start += 1
    if body[start : start + 1] == b'"':
        # SGLang's shape: a base64 string (no `"` or `\\` inside), so its end is the next quote.
        end = body.find(b'"', start + 1)
        if end < 0:
            return body, None
        return body[:start] + b"null" + body[end + 1 :], memoryview(body)[start + 1 : end]
    if body[start : start + 1] != b"[":
        return body, None
    ends = [i for i in (body.find(b"}", start), body.find(b'"', start)) if i >= 0]
    if not ends:
        return body, None
    end = min(ends)
    while end > start and body[end - 1] in b" \t\r\n,":
        end -= 1
    if body[end - 1 : end] != b"]":
        return body, None
    # A view, not a copy: the record keeps the engine's bytes alive instead of duplicating megabytes.
    return body[:start] + b"null" + body[end:], memoryview(body)[start:end]


def decode_engine_reply(
    body: bytes, vocab_size: int, split: tuple[bytes, memoryview | None] | None = None,
    sampling_mask_bound: int | None = None,
) -> GenerateResult:
    """Strictly validate an engine reply (UpstreamError, 502, on any broken rule), routed experts cut out first.

    `split` is `split_routed_experts(body)` when the caller already made the cut (to size the work that is left).
    `sampling_mask_bound`: the request asked for sampling masks under this top-k (decode_generate_response).
    """
    small, routed = split if split is not None else split_routed_experts(body)
    bound = sampling_mask_bound
    if routed is None:
        return decode_generate_response(body, vocab_size, bound)
    try:
        return dataclasses.replace(decode_generate_response(small, vocab_size, bound), routed_experts=routed)
    except UpstreamError:
        return decode_generate_response(body, vocab_size, bound)  # the cut went wrong: the full strict decode decides
