"""The radix-cache key of a weight version: what every engine request carries as SGLang's `extra_key` (issue 38).

Why: SGLang flushes its radix cache on a weight update only when nothing runs, and in asynchronous RL something always
runs, so after an update in place the next turn of every session would reuse KV the old weights computed, and its
tokens would be sampled by neither policy (measured on 0.5.23: 269 of 284 prompt tokens served from the old weights'
cache, sampled tokens up to 0.20 off the new weights' recompute). `extra_key` partitions the cache (it is how SGLang
keeps LoRA adapters apart): a request keyed by its weight version reuses only prefixes computed under that version,
and within one version prefixes are reused as before. Which version each engine serves is the server's belief
(engine/placement.py `Worker.weight_version`): told by the push (`POST /admin/continue {"weight_version"}`, else asked
of the engine's `/model_info`) and checked on every reply (`meta_info.weight_version`, turns/output.py).

A belief can be wrong (weights pushed behind the server's back), and the engine stores a request's KV under the key the
request carried, whatever weights computed it: once a reply shows that a key's namespace got KV of other weights, the
version's key moves to a fresh namespace (`generation`), so that those entries are never reused for it.
"""

from __future__ import annotations

DEFAULT_VERSION = "default"  # SGLang's weight version until a trainer names one


def cache_key(version: str, generation: int = 0) -> str:
    """The `extra_key` of requests meant for weights `version` (never "", which SGLang reads as no key); `generation`
    counts the namespaces of that version found to hold KV of other weights."""
    return f"weights:{version}" if generation == 0 else f"weights:{version}#{generation}"


def version_number(version: str) -> int | None:
    """A version as the step it names: "default" is 0, an integer string its value; None for any other name."""
    if version == DEFAULT_VERSION:
        return 0
    try:
        return int(version)
    except ValueError:
        return None


def version_lag(old: str, new: str) -> int:
    """How many versions `new` is past `old` (--max-staleness): their steps' difference, or 1 for two names that are
    not steps and differ."""
    a, b = version_number(old), version_number(new)
    if a is not None and b is not None:
        return max(0, b - a)
    return 0 if old == new else 1
