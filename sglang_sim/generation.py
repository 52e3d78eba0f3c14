"""Deterministic reply planning: what the sim "samples" for a prompt, with the logprobs it sampled them at.

Why plan the whole reply up front: the output of a real model is a function of (weights, prompt, seed); here it is a
function of (engine seed, prompt ids, sampling_seed) and the prompt's `[[sim: ...]]` directives, so tests can
predict it and agents can script tool loops. Planning once also gives the exact KV reservation a request needs and
lets stop conditions (stop tokens, stop strings, max_new_tokens) be resolved before any latency is spent. The
per-token emission (latency, abort, pause) is the scheduler's business.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_sim.constraints import StructuralTag, allowed_calls, json_text, tool_calls_text
from sglang_sim.directives import MARK, PATTERN, Script, read
from sglang_sim.family import EngineFamily

_WORD_TEXT = (
    "the of and to in is was for on are with as at be by this from or have an they which one you were all we her "
    "she there would their will when who him been has more if no out so said what up its about into than them can "
    "only other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since against "
    "go came right used take three river stone cloud garden signal vector kernel lattice harbor meadow copper"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())



@dataclass(frozen=True)
class SamplingParams:
    """The subset of SGLang's sampling parameters that changes what the sim emits."""

    max_new_tokens: int = 128  # the engine resolves a request's null to what its context leaves (Engine.submit)
    temperature: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: Any = None  # parsed schema: the reply's content is an instance of it
    structural_tag: StructuralTag | None = None  # the reply's tool calls follow it
    stream_interval: int | None = None  # tokens per stream event (the engine's --stream-interval when None)

    @property
    def penalty(self) -> int:
        """+1: repetition is penalised (no word repeats); -1: rewarded (one word repeats); 0: neutral."""
        score = self.presence_penalty + self.frequency_penalty + (self.repetition_penalty - 1.0)
        return 0 if abs(score) < 1e-9 else (1 if score > 0 else -1)


@dataclass
class ReplyPlan:
    """Every token the request will emit, its logprob, and how it finishes if it runs to the end."""

    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, log of the probability each token was sampled with
    finish_reason: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def find_script(family: EngineFamily, prompt: np.ndarray) -> Script | None:
    """Directives of the LAST message that carries any; None when the prompt has none."""
    if MARK not in family.decode_text(prompt, skip_special_tokens=False):
        return None  # one decode settles the common, unscripted case
    for seg in reversed(family.message_segments(prompt)):
        text = family.segment_text(seg)
        if MARK in text and PATTERN.search(text):
            for start in family.family.inline_message_starts:  # messages merged into one turn: the last one's
                text = next((part for part in reversed(text.split(start)) if PATTERN.search(part)), text)
            return read(text)
    return None


def derive_seed(engine_seed: int, prompt: np.ndarray, sampling_seed: int | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(engine_seed.to_bytes(8, "little", signed=True))
    h.update(np.ascontiguousarray(prompt, dtype=np.int32).tobytes())
    h.update(b"-" if sampling_seed is None else int(sampling_seed).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def _words(rng: np.random.Generator, n: int) -> str:
    idx = rng.integers(0, len(WORDS), size=n)
    return " ".join(WORDS[i] for i in idx)


def _word_tokens(family: EngineFamily, rng: np.random.Generator, n_tokens: int,
                 params: SamplingParams | None = None) -> list[int]:
    """Exactly n_tokens tokens of seeded words (ASCII, so any prefix decodes cleanly).

    Words are encoded one by one from a cache: byte-level BPE pre-splits at spaces, so the concatenation equals
    the encoding of the joined text, without paying the tokenizer per reply.

    Penalties and logit_bias act the way their sign says, deterministically: a word containing a token with a
    negative bias is never emitted, tokens with a positive bias come first (highest bias first), a positive
    presence/frequency/repetition penalty never repeats a word, a negative one repeats the first word.
    """
    bias = params.logit_bias if params is not None else {}
    penalty = params.penalty if params is not None else 0
    banned = {t for t, b in bias.items() if b < 0}
    out: list[int] = [t for t, b in sorted(bias.items(), key=lambda kv: (-kv[1], kv[0])) if b > 0]
    used: set[int] = set()
    first: int | None = None
    guard = 0
    while len(out) < n_tokens:
        guard += 1
        if guard > 64:
            raise ValueError("logit_bias bans every word sglang-sim can emit")
        order = rng.permutation(len(WORDS)) if penalty > 0 else rng.integers(0, len(WORDS), size=max(4, n_tokens))
        for i in order:
            i = int(i)
            if penalty > 0 and i in used:
                continue
            if penalty < 0 and first is not None:
                i = first
            ids = family.encode_cached((" " if out else "") + WORDS[i])
            if banned and banned.intersection(ids):
                continue
            used.add(i)
            first = i if first is None else first
            out.extend(ids)
            if len(out) >= n_tokens:
                break
        if penalty > 0 and len(used) >= len(WORDS):
            used.clear()
    return out[:n_tokens]


def _closes_thinking(family: EngineFamily, prompt: np.ndarray) -> bool:
    """The prompt already ends with an (empty) reasoning block, as Qwen3's template writes for enable_thinking=False:
    the model answers right away, without reasoning of its own."""
    return family.decode_text(prompt[-12:], skip_special_tokens=False).rstrip("\n").endswith("</think>")


# How xgrammar's builtin formats spell the tool name in a tag's begin: Qwen's XML, DSML, harmony's recipient.
_NATIVE_NAME = re.compile(r'(?:<function=|invoke name="|to=functions\.)([^">\s<]+)')


def _tool_name(family: EngineFamily, begin: str) -> str | None:
    structure = getattr(family.family, "tool_call_structure", None)
    if structure is None:
        native = _NATIVE_NAME.search(begin)
        return native.group(1) if native else None
    prefix, suffix = structure[0], structure[1]
    if begin.startswith(prefix) and begin.endswith(suffix) and len(begin) > len(prefix) + len(suffix):
        return begin[len(prefix): len(begin) - len(suffix)]
    return None


def grammar_first(params: SamplingParams, reasoning_gate: bool) -> bool:
    """Whether the request's grammar leaves no room for reasoning before it: a JSON answer or a forced tool call (a
    grammar that starts with the call), applied from the first token. SGLang holds it back until the reasoning ends
    when the request says `require_reasoning` and the engine runs with `--reasoning-parser` (`reasoning_gate`);
    auto tool calls (triggered tags) admit any text before a call, reasoning included, either way."""
    tag = params.structural_tag
    return (params.json_schema is not None or (tag is not None and tag.at_least_one)) and not reasoning_gate


def plan_reply(family: EngineFamily, prompt: np.ndarray, params: SamplingParams, engine_seed: int,
               reasoning_gate: bool = False) -> ReplyPlan:
    """The deterministic reply for this prompt; stop conditions already applied. `reasoning_gate`: the engine holds
    a grammar back until the reasoning ends (`grammar_first`)."""
    seed = derive_seed(engine_seed, prompt, params.sampling_seed)
    # Independent streams, so a reply cut by max_new_tokens is a prefix (tokens and logprobs) of the uncut one.
    rng, think_rng, prob_rng, grammar_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
    script = find_script(family, prompt) or Script()
    think = script.think and not _closes_thinking(family, prompt)
    # A prompt that already opened the reasoning block (Qwen3.5's `<think>\n`): the reply starts inside it and must
    # close it, with reasoning or without -- unless a grammar applies from the first token, which writes its own text
    # right there (inside the open block: the model never closes it).
    opened = family.family.opened_reply(prompt)
    if grammar_first(params, reasoning_gate):
        reasoning = None
    else:
        reasoning = _words(think_rng, int(think_rng.integers(6, 18))) if think else ("" if opened else None)
    content_ids: list[int] | None = None
    tag = params.structural_tag
    if params.json_schema is not None:
        content = json_text(params.json_schema, grammar_rng)  # the grammar leaves no room for tool calls
    elif tag is not None and tag.at_least_one:
        content = ""  # a forced tool call: the grammar starts with the call
    elif script.reply is not None:
        content = script.reply
    elif script.tool_calls and script.tokens is None:
        content = ""
    else:
        n = script.tokens if script.tokens is not None else int(rng.integers(10, 40))
        # the rest is never emitted
        content_ids = _word_tokens(family, rng, min(n, params.max_new_tokens + 1), params)
        content = family.decode_text(content_ids, skip_special_tokens=False)
    calls = [] if params.json_schema is not None else list(script.tool_calls)
    if tag is not None and tag.native:  # the calls the tag lets through, in the family's own format
        allowed = allowed_calls(tag, calls, grammar_rng, lambda begin: _tool_name(family, begin))
        text = family.family.format_completion(content, reasoning, [(_tool_name(family, s.begin) or "", args)
                                                                    for s, args in allowed])
    elif tag is not None:
        constrained = tool_calls_text(tag, calls, grammar_rng, lambda begin: _tool_name(family, begin))
        head = family.family.format_completion("", reasoning, [])
        text = head + (content + "\n" + constrained if content and constrained else content or constrained)
    else:
        text = family.family.format_completion(content, reasoning, calls)
    text = text.removeprefix(opened)
    body = content_ids if content_ids is not None and text == content else family.encode(text)
    eos = int(family.family.stop_token_after(text))
    if params.ignore_eos:
        # Keep "sampling" past the stop token, as a model told to ignore EOS does, until the length limit.
        filler = _word_tokens(family, rng, max(0, params.max_new_tokens - len(body) - 1))
        ids = [*body, eos, *filler]
    else:
        ids = [*body, eos]
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(int(t) for t in family.family.stop_token_ids)
    finish: dict[str, Any] | None = None
    cut = len(ids)
    for i, tok in enumerate(ids):
        if tok in stop_ids:
            cut, finish = i + 1, {"type": "stop", "matched": tok}
            break
    if params.stop:
        hit = _first_stop_string(family, ids[:cut], params.stop)
        if hit is not None:
            cut, finish = hit[0], {"type": "stop", "matched": hit[1]}
    if cut > params.max_new_tokens:
        cut, finish = params.max_new_tokens, {"type": "length", "length": params.max_new_tokens}
    if finish is None:
        finish = {"type": "length", "length": params.max_new_tokens}
    output = np.asarray(ids[:cut], dtype=np.int32)
    probs = np.maximum(prob_rng.uniform(0.3, 0.99, size=cut), min(params.min_p, 0.99))
    if params.temperature <= 0 or params.top_k == 1:
        logprobs = np.zeros(cut, dtype=np.float32)  # greedy: the argmax is taken with probability 1
    else:
        logprobs = (np.log(probs) / params.temperature).astype(np.float32)
        np.maximum(logprobs, np.float32(-30.0), out=logprobs)
    return ReplyPlan(output_ids=output, logprobs=logprobs, finish_reason=finish)


def _first_stop_string(family: EngineFamily, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Smallest token count whose decoded text contains a stop string, and that string (binary search on prefixes)."""
    full = family.decode_text(ids, skip_special_tokens=False)
    if not any(s and s in full for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s and s in family.decode_text(ids[:mid], skip_special_tokens=False) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = family.decode_text(ids[:lo], skip_special_tokens=False)
    matched = min((s for s in stops if s and s in text), key=text.find)
    return lo, matched


def output_text(family: EngineFamily, ids: np.ndarray, finish: dict[str, Any] | None, params: SamplingParams) -> str:
    """The `text` SGLang returns: the matched stop token or stop string is trimmed unless `no_stop_trim`."""
    matched = finish.get("matched") if finish and finish.get("type") == "stop" else None
    if isinstance(matched, int) and not params.no_stop_trim and len(ids):
        ids = ids[:-1]
    text = family.decode_text(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return text
