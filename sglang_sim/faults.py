"""Fault injection: ways a real engine (or the network in front of it) breaks its responses.

Why in the engine: the session server must turn every malformed engine response into a 502 without committing
anything, and must survive dropped connections and slow replies. Faults are chosen per request (header
`X-Sim-Fault`) or at random (`POST /sim/faults` probabilities). They only ever corrupt the bytes on the wire, after
the request has ended normally inside the engine, so they can never corrupt the KV books (`value_error` refuses the
request before it reaches the engine, as SGLang refuses a bad value).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import msgspec

from sglang_sim.requests import BadRequest

BODY_FAULTS = ("malformed_json", "nan_logprob", "str_logprob", "bool_token", "str_token", "oob_token",
               "length_mismatch", "nan_happened")
FAILING_FAULTS = ("http_500", *BODY_FAULTS, "drop_connection")  # each one fails the chat (502) and commits nothing
# value_error: the request refused as SGLang's tokenizer manager refuses a bad value (a 400, or HTTP 200 with an error
# event when streamed): the engine's own answer, which the session server passes on with its status.
# mask_overflow: with return_sampling_mask, the sampler's realised support at the reply's middle token exceeds
# --sampling-mask-max-tokens (cut-off ties on a GPU top-k kernel; the sim's own distribution has none) and the engine
# aborts the request there, as SGLang does (sampling_masks.py): a 400, or the streamed abort event with status 400.
FAULTS = (*FAILING_FAULTS, "delay", "value_error", "mask_overflow")
_NAN_MARK = "__sim_nan_logprob__"


@dataclass(frozen=True)
class Fault:
    name: str
    delay: float = 0.0


def parse_fault(value: str | None, default_delay: float) -> Fault | None:
    """Header syntax: one fault name, or `delay=SECONDS`."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.startswith("delay"):
        _, _, secs = value.partition("=")
        try:
            return Fault("delay", float(secs) if secs else default_delay)
        except ValueError as exc:
            raise BadRequest(f"bad X-Sim-Fault delay: {value!r}") from exc
    if value not in FAULTS:
        raise BadRequest(f"unknown X-Sim-Fault {value!r}; known: {', '.join(FAULTS)}")
    return Fault(value)


class FaultInjector:
    """Per-request choice between the header's fault and the configured random ones."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.probabilities: dict[str, float] = {}
        self.delay_seconds = 0.5
        self.injected: dict[str, int] = {}

    def configure(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest("faults must be a JSON object of probabilities")
        probs: dict[str, float] = {}
        for name, p in body.items():
            if name == "delay_seconds":
                if isinstance(p, bool) or not isinstance(p, int | float) or p < 0:
                    raise BadRequest("delay_seconds must be a non-negative number")
                self.delay_seconds = float(p)
                continue
            if name not in FAULTS:
                raise BadRequest(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
            if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1:
                raise BadRequest(f"probability of {name} must be in [0, 1]")
            if p > 0:
                probs[name] = float(p)
        if sum(probs.values()) > 1:
            raise BadRequest("fault probabilities must sum to at most 1")
        self.probabilities = probs
        return self.state()

    def state(self) -> dict[str, Any]:
        return {"probabilities": dict(self.probabilities), "delay_seconds": self.delay_seconds,
                "injected": dict(self.injected)}

    def pick(self, header: str | None) -> Fault | None:
        fault = parse_fault(header, self.delay_seconds)
        if fault is None and self.probabilities:
            x = self.rng.random()
            for name, p in self.probabilities.items():
                if x < p:
                    fault = Fault(name, self.delay_seconds if name == "delay" else 0.0)
                    break
                x -= p
        if fault is not None:
            self.injected[fault.name] = self.injected.get(fault.name, 0) + 1
        return fault


def corrupt(body: dict[str, Any], fault: Fault, vocab_size: int) -> bytes:
    """Encode a `/generate` body with the fault's damage; rules of docs/design.md 5.3 each get one violation."""
    meta = body["meta_info"]
    entries = meta.get("output_token_logprobs")
    ids = body["output_ids"]
    name = fault.name
    if name in ("nan_logprob", "str_logprob", "bool_token", "str_token", "oob_token") and not ids:
        name = "length_mismatch"  # nothing to damage in an empty reply: break the count instead
    if name == "length_mismatch":
        meta["completion_tokens"] = meta["completion_tokens"] + 1
    elif name == "nan_happened":
        # schedule_batch.py Req._check_vocab_boundary_finish: the NaN sample's out-of-vocabulary id is replaced by
        # a stop id and the request finishes with this reason (well-formed in every other respect).
        meta["finish_reason"] = {"type": "stop", "matched": "NaN happened"}
    elif name in ("nan_logprob", "str_logprob"):
        if entries:
            entries[0] = [_NAN_MARK if name == "nan_logprob" else str(entries[0][0]), *entries[0][1:]]
        else:
            meta["output_token_logprobs"] = [[_NAN_MARK if name == "nan_logprob" else "-0.5", ids[0], None]]
    elif name in ("bool_token", "str_token", "oob_token"):
        bad: Any = {"bool_token": True, "str_token": str(ids[0]), "oob_token": vocab_size + 7}[name]
        ids[0] = bad
        if entries:
            entries[0] = [entries[0][0], bad, *entries[0][2:]]
    raw = msgspec.json.encode(body)
    if name == "nan_logprob":
        raw = raw.replace(f'"{_NAN_MARK}"'.encode(), b"NaN", 1)
    if name == "malformed_json":
        raw = raw[: max(1, len(raw) // 2)]
    return raw
