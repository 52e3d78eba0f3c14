"""What a model family is: its chat template, its token rules and its completion parsers, in one object.

TITO's incremental rule depends on how a template writes a message boundary, so a family declares that
boundary (`assistant_header`, the template's stop token, `message_trailer`) instead of the server
guessing from rendered strings. Incremental turns never re-render the real history (templates such as
Qwen3's rewrite earlier turns depending on where the last user query is): the appended messages are
rendered after a fixed, tiny ANCHOR conversation whose own rendering is known, and cut at the end of the
anchor's assistant message. If appending changes how the anchor renders, the template is not
append-stable for that request and we refuse it (TemplateError) rather than guess.
"""

from __future__ import annotations

import hashlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import RequestValidationError, TemplateError, TokenizationError
from ..first_turns import FirstTurnCache
from ..images import Vision
from .control import ControlTokens, trie_pattern
from .fast_encoder import FastEncoder, fast_encoder
from .span_cache import MIN_SPAN_CHARS, SpanCache

# The anchor conversation: plain text, no reasoning, no tool calls, so every template renders it the
# same way whatever follows it, unless the template is genuinely not append-stable.
_ANCHOR: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "anchor question"},
    {"role": "assistant", "content": "anchor answer"},
)
_PROBE: dict[str, str] = {"role": "user", "content": "anchor probe"}
_ANCHOR_CACHE_SIZE = 64


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    content: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_message(self, call_id_prefix: str) -> dict[str, Any]:
        """The OpenAI assistant message; tool-call ids are `{prefix}_{i}` so they are reproducible from the rid."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"{call_id_prefix}_{i}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for i, call in enumerate(self.tool_calls)
            ]
        return message


def tool_call_from_json(name: Any, arguments: Any) -> ToolCall | None:
    """A well-formed call has a non-empty string name and a JSON object of arguments; anything else is None."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def tools_cache_key(tools: list[dict[str, Any]] | None) -> str:
    """A string that is equal for two tool lists exactly when a chat template renders them identically.

    Order-preserving JSON (not `sort_keys`): `tojson` keeps key order, and JSON text also tells 1 from 1.0 and
    true from 1, which Python's `==` does not.
    """
    return json.dumps(tools, ensure_ascii=False) if tools else ""


def first_difference(a: str, b: str) -> int:
    """Index of the first differing character (len of the shorter string if one is a prefix of the other)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ModelFamily(ABC):
    """Base class: a subclass sets the class attributes and implements the two completion parsers."""

    name: ClassVar[str]
    eos_token: ClassVar[str]                  # the stop token the template writes after a message
    extra_stop_tokens: ClassVar[tuple[str, ...]] = ()  # other tokens the model may stop on
    # False when the model does not stop on `eos_token` (harmony's `<|end|>` ends one message of a reply that goes on).
    eos_is_stop: ClassVar[bool] = True
    # Stop tokens the template also writes after a message (harmony's `<|call|>`): a completion ending on one is closed
    # as it is, where one ending on another extra stop token has it replaced by `eos_token`.
    closing_stop_tokens: ClassVar[tuple[str, ...]] = ()
    message_trailer: ClassVar[str]            # text the template writes after `eos_token`
    assistant_header: ClassVar[str]           # text that opens an assistant message (the generation prompt)
    appendable_roles: ClassVar[frozenset[str]]
    # (begin prefix, begin suffix, end, trigger) around one tool call's JSON arguments, as SGLang's tool-call
    # detector for the family declares it (`structure_info`); used to constrain forced tool calls. None: no format.
    # The template writes `tools` only in its preamble, never into how a later message renders. Then an appended
    # turn is rendered without the tool schemas: the same text (tests/unit/trajectory/test_tito.py checks
    # incremental
    # prompts against full renders with tools), without re-rendering kilobytes of schemas on every turn.
    tools_only_in_preamble: ClassVar[bool] = False
    tool_call_structure: ClassVar[tuple[str, str, str, str] | None] = None
    # The model-native structural tag SGLang's detector for the family asks xgrammar for (`get_structural_tag_name`:
    # `qwen_3_coder`, `deepseek_v4`, `harmony`), which then takes the place of `tool_call_structure`.
    structural_tag_format: ClassVar[str | None] = None
    # Added tokens the template itself looks for inside message text (reasoning split off an assistant's content):
    # they keep the tokenizer's meaning in content; every other added token's spelling in content is text.
    content_markup: ClassVar[tuple[str, ...]] = ()
    # (open, close) of the reasoning block and of a tool-call block in generated text: where a streamed reply may
    # still change meaning, so streaming holds text back around them. None: the family streams nothing early.
    reasoning_markers: ClassVar[tuple[str, str] | None] = None
    tool_call_markers: ClassVar[tuple[str, str] | None] = None
    # A family whose reply is not one text with markers in it (harmony's messages) says itself how far a streamed text
    # is settled (`stream_settled`); `stream_markers` are then the spellings past which plain text may change meaning.
    stream_markers: ClassVar[tuple[str, ...]] = ()
    # The template variable that turns the model's reasoning on or off (Qwen3's `enable_thinking`), which the
    # Responses and Anthropic front ends set from `reasoning.effort` / `thinking`. None: the family has no switch.
    thinking_switch: ClassVar[str | None] = None
    # Whether a turn is in thinking mode when the request leaves `thinking_switch` unset, as SGLang 0.5.23's chat
    # server decides it (`_get_reasoning_from_request`: the template's toggle and its default, or a reasoning parser
    # that is always on); True without a switch: the model always reasons. None: the model does not reason.
    thinking_default: ClassVar[bool | None] = None
    # SGLang's `--reasoning-parser` for the family (the one SGLang suggests for its template): an engine holds a
    # grammar back until the reasoning ends only with it. None: the model does not reason.
    sglang_reasoning_parser: ClassVar[str | None] = None
    # Text a generation prompt may end with that belongs to the reply (Qwen3.5's `<think>\n` with thinking on): the
    # engine's text then starts after it, so parsing a reply puts it back first (`opened_reply`).
    reply_opening: ClassVar[str] = ""
    # Where a message starts inside one rendered turn without an added token to mark it (DeepSeek V4 merges tool
    # results into a user turn as `<tool_result>` text): the emulated engine reads the last message's directives.
    inline_message_starts: ClassVar[tuple[str, ...]] = ()
    # sha256 of the chat templates `render_appended` mirrors: a family opts in to its path around the template by
    # naming them, and a tokenizer that carries any other template (a fine-tune's edit, an operator's override) has
    # every turn rendered by that template.
    mirrored_templates: ClassVar[frozenset[str]] = frozenset()
    # Image facts of a vision-language family (trajectory/images.py); None: the model takes text only.
    vision: Vision | None = None

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.mirrors_template: bool = isinstance(template, str) and \
            hashlib.sha256(template.encode()).hexdigest() in self.mirrored_templates
        self._spans: SpanCache | None = None  # set below, once the added tokens are known
        # Whole first turns by their inputs; none for a template that reads the clock (first_turns.py).
        self.first_turns = FirstTurnCache(enabled="strftime_now" not in str(template or ""))
        # The Rust tokenizer directly: half the cost of the transformers wrapper, same ids (test_tokenizers.py).
        # `encode_batch_fast` of one text: no character offsets computed (encode's, unused here: ~15 % of a short
        # text's cost), and the GIL is released while it runs, so a megabyte prompt tokenized on the pool does not
        # hold the event loop (measured before: 4.3 MB with `encode`, /health frozen for 8.7 s).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encode_fast = getattr(backend, "encode_batch_fast", None)
        # The model's own vocabulary (the wrapper's `get_vocab` adds the added tokens' spellings to it).
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False) if backend is not None else \
            tokenizer.get_vocab()
        # tiktoken, where it is provably the same function (fast_encoder.py): ~5x faster on an appended turn.
        self.fast_encoder: FastEncoder | None
        self.fast_encoder_refusal: str  # why there is none ("" when there is one)
        self.fast_encoder, self.fast_encoder_refusal = fast_encoder(tokenizer, vocab)
        self.vocab_size: int = len(tokenizer)
        self.eos_token_id: int = self._single_id(self.eos_token)
        self.stop_token_ids: tuple[int, ...] = (
            *((self.eos_token_id,) if self.eos_is_stop else ()), *(self._single_id(t) for t in self.extra_stop_tokens)
        )
        self._closing_ids = frozenset({self.eos_token_id, *map(self._single_id, self.closing_stop_tokens)})
        # Template punctuation: where token-level diffs can resynchronise (see mismatch.py).
        self.special_token_ids: frozenset[int] = frozenset(
            {*getattr(tokenizer, "added_tokens_decoder", {}), *self.stop_token_ids}
        )
        # Spellings of added tokens inside message text stay text (control.py), except the template's own markup.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        # No token covers more characters than its vocabulary entry has bytes (bounds.py: prompts refused unrendered).
        self.max_token_chars: int = max(map(len, [*vocab, *(t.content for t in added.values())]), default=1)
        self.control = ControlTokens(
            (t.content for t in added.values() if t.content not in self.content_markup), self.encode,
            frozenset(added),
        )
        # Long repeated spans between added-token spellings (the tool preamble) are tokenized once (span_cache.py).
        # Only where the tokenizer splits at them before anything else: non-normalized, no whitespace stripping.
        boundaries = [t for t in added.values() if not t.normalized]
        if boundaries and not any(t.lstrip or t.rstrip for t in boundaries):
            self._spans = SpanCache(trie_pattern(t.content for t in boundaries), self._encode_text)
        # A completion that ended on a non-template stop token has that token replaced by `eos_token`.
        self.max_trim_tokens: int = 1 if self.extra_stop_tokens else 0
        self._anchor_lock = threading.Lock()
        self._anchor_prefixes: dict[str, str] = {}
        self._opening_ids: tuple[int, ...] = tuple(self.encode(self.reply_opening)) if self.reply_opening else ()

    def _single_id(self, token: str) -> int:
        ids = self.encode(token)
        if len(ids) != 1:
            raise TokenizationError(f"family {self.name}: {token!r} is not a single token in this tokenizer ({ids})")
        return ids[0]

    # -- stop tokens -------------------------------------------------------------------------------------
    def closes_message(self, last_token: int | None) -> bool:
        """Whether a completion ending on `last_token` ends exactly as the template ends that message."""
        return last_token in self._closing_ids

    def trimmed_tokens(self, last_token: int | None) -> int:
        """How many tokens of a completion ending on `last_token` the next prompt replaces (a stop token the template
        does not write there: Qwen3's `<|endoftext|>`, harmony's `<|return|>`)."""
        return int(not self.closes_message(last_token) and last_token in self.stop_token_ids)

    def open_message_end(self, message: Mapping[str, Any]) -> str:
        """What the template writes after `message`, a generated reply that ended on no stop token (cut by length)."""
        return self.eos_token

    def stop_token_after(self, text: str) -> int:
        """The stop token a model ends the reply `text` (format_completion's) with: the emulated engine's choice."""
        return self.eos_token_id

    def appended_messages(self, messages: Sequence[Mapping[str, Any]], start: int) -> list[dict[str, Any]]:
        """`messages[start:]`, the messages appended after stored turns, as the template renders them on their own
        (harmony names a tool result's author by its call, which is in the history)."""
        return [dict(m) for m in messages[start:]]

    # -- text <-> ids ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens inserted (templates already write BOS where needed)."""
        if len(text) >= 2 * MIN_SPAN_CHARS and self._spans is not None:
            return self._spans.encode(text)
        return self._encode_text(text)

    def _encode_text(self, text: str) -> list[int]:
        if self.fast_encoder is not None:
            ids = self.fast_encoder.encode(text)
            if ids is not None:
                return ids
        if self._encode_fast is not None:
            return list(self._encode_fast([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int] | Any) -> str:
        return str(self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False))

    # -- chat template -----------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        """`template_kwargs` are the request's `chat_template_kwargs` (e.g. Qwen3's `enable_thinking`), passed to
        the template as extra variables exactly as SGLang's OpenAI server does."""
        try:
            return str(self.tokenizer.apply_chat_template(
                list(messages), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            ))
        except Exception as exc:  # jinja raise_exception / undefined fields: the request is unrenderable
            raise TemplateError(f"chat template of family {self.name} cannot render the request: {exc}") from exc

    def _anchor_end(self, text: str) -> int:
        """End of the anchor's assistant message (its stop token and trailer included)."""
        # Search from the anchor's answer, not from the first header: a system/tools preamble may quote one. The
        # answer may follow the header after template markup (Qwen3.5's empty `<think>` block after the last query).
        header = text.find(self.assistant_header)
        answer = text.find(_ANCHOR[1]["content"], header) if header >= 0 else -1
        end_marker = self.eos_token + self.message_trailer
        end = text.find(end_marker, answer) if answer >= 0 else -1
        if end < 0:
            raise TemplateError(f"chat template of family {self.name} does not close the assistant message "
                                f"with {end_marker!r}")
        return end + len(end_marker)

    def anchor_probe(self, appended: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """The message rendered after the anchor to learn its prefix: one that leaves the anchor rendered as it is
        when `appended` follows it (a template that treats turns after the last user query differently needs a
        non-user probe when no user message is appended)."""
        return _PROBE

    def anchor_prefix(self, tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None = None, probe: dict[str, str] = _PROBE) -> str:
        """How the anchor renders when more messages follow it; cached per tools value (tools rarely change).

        The key is the tools exactly as the template sees them: key order included. Templates write schemas with
        `tojson`, which keeps the caller's key order, so two clients whose schemas differ only in key order render
        different text; a key that sorted keys would hand one of them the other's prefix (and a 400).
        """
        key = probe["role"] + "\x00" + tools_cache_key(tools)
        if template_kwargs:
            key += "\x00" + json.dumps(template_kwargs, ensure_ascii=False)
        cached = self._anchor_prefixes.get(key)
        if cached is not None:
            return cached
        text = self.render([*_ANCHOR, probe], tools, add_generation_prompt=False, template_kwargs=template_kwargs)
        prefix = text[: self._anchor_end(text)]
        with self._anchor_lock:
            if len(self._anchor_prefixes) >= _ANCHOR_CACHE_SIZE:
                self._anchor_prefixes.clear()
            self._anchor_prefixes[key] = prefix
        return prefix

    def appended_text(self, appended: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      closed: bool, template_kwargs: dict[str, Any] | None = None, end: str | None = None) -> str:
        """Text to tokenize and append after a generated assistant turn, ending with the generation prompt.

        `closed` says whether the stored tokens already end as the template ends the message; if not (the model
        stopped on another stop token, which the caller trims, or ran out of length) the text starts with `end`
        (default `eos_token`).
        """
        for message in appended:
            if message["role"] not in self.appendable_roles:
                raise RequestValidationError(
                    f"family {self.name} cannot append a {message['role']!r} message after a generated turn "
                    f"(appendable roles: {', '.join(sorted(self.appendable_roles))})"
                )
        if not appended:
            raise RequestValidationError("the request adds no message after the stored history")
        if self.tools_only_in_preamble:
            tools = None
        text = self.render_appended(appended, tools, template_kwargs) if self.mirrors_template else None
        if text is None:
            prefix = self.anchor_prefix(tools, template_kwargs, self.anchor_probe(appended))
            full = self.render([*_ANCHOR, *appended], tools, add_generation_prompt=True,
                               template_kwargs=template_kwargs)
            if not full.startswith(prefix):
                roles = [m["role"] for m in appended]
                raise TemplateError(
                    f"chat template of family {self.name} rewrites earlier messages when appending {roles}: "
                    f"rendered prefix differs at character {first_difference(prefix, full)}"
                )
            text = full[len(prefix):]
        lead = self.message_trailer if closed else (end or self.eos_token) + self.message_trailer
        return lead + text

    def render_appended(self, appended: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None,
                        template_kwargs: dict[str, Any] | None) -> str | None:
        """What the template writes for `appended` after an assistant message, the generation prompt included,
        without running it; None (the default): the template renders it.

        Why: an appended turn is a user or tool message or two, and running the Jinja template for them was the
        largest share of a turn's CPU. A family opts in by overriding this where its template is plain enough to
        mirror and naming that template in `mirrored_templates`; it returns None for every request outside what it
        mirrors (then the template decides, as always). tests/unit/trajectory/test_tito.py holds every
        family's
        answer to its template's, byte for byte."""
        return None

    # -- completion text <-> message -------------------------------------------------------------------
    def completion_text(self, output_ids: Sequence[int] | Any) -> str:
        """The generated text from the generated ids (one trailing stop token dropped), decoded locally.

        For callers that hold only ids (offline tools, tests). The server does not use it: it parses the engine's
        `text`, see `parse_completion`.
        """
        ids = list(map(int, output_ids))
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def parse_output(self, output_ids: Sequence[int] | Any, prompt_ids: Sequence[int] | Any = ()) -> ParsedCompletion:
        return self.parse_completion(self.opened_reply(prompt_ids) + self.completion_text(output_ids))

    def opened_reply(self, prompt_ids: Sequence[int] | Any) -> str:
        """The part of the reply the prompt already wrote (`reply_opening` when the prompt ends with it, else "")."""
        n = len(self._opening_ids)
        if n and len(prompt_ids) >= n and tuple(int(i) for i in prompt_ids[-n:]) == self._opening_ids:
            return self.reply_opening
        return ""

    def thinking_mode(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the model reasons before it answers this turn (SGLang's `thinking_mode`), from the request's
        `chat_template_kwargs`: a default-on switch is on unless set to exactly false, a default-off switch on only
        when set to exactly true (SGLang compares with `is`, so 0 or "no" leave the default)."""
        default = self.thinking_default
        if default is None or self.thinking_switch is None:
            return bool(default)
        value = (template_kwargs or {}).get(self.thinking_switch)
        return value is not False if default else value is True

    def parse_reply(self, text: str, tool_calls: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        """`parse_completion`, or with `tool_calls=False` (the request said `tool_choice: none` or asked for JSON)
        reasoning split off but any tool-call markup left in the content verbatim, as SGLang does when tool-call
        parsing is inactive. `text` starts with `opened_reply(prompt)`; `tools` are the turn's (XML-call families
        type the arguments by their schemas)."""
        if tool_calls:
            return self.parse_completion(text, tools)
        reasoning, rest = self.split_reasoning(text)
        return ParsedCompletion(content=rest, reasoning_content=reasoning)

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """(reasoning, the rest) of a generated text; a family without reasoning returns (None, text)."""
        return None, text

    def reasoning_end(self, output_ids: Sequence[int] | Any) -> int | None:
        """How many of the generated ids the reasoning takes, for a family that locates it itself (harmony's analysis
        messages); None: it ends at `reasoning_markers`' closing token (session_server/frontend/reply_facts.py)."""
        return None

    def stream_settled(self, text: str) -> tuple[int, bool] | None:
        """(end, holding) for a family with `stream_markers`: `text[:end]` parses as every longer text will (what
        streaming may send), and `holding` says a message after `end` is held back whole until it ends. None: the
        generic rule of session_server/turns/deltas.py over `reasoning_markers` and `tool_call_markers`."""
        return None

    @abstractmethod
    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        """Generated text (without the stop token, after `opened_reply`) -> content, reasoning and tool calls.

        The server parses SGLang's own `text` of the reply, not a local decode of `output_ids`: the ids are what is
        trained on and are stored verbatim, while `text` is what the agent is shown (SGLang's detokenization with
        `skip_special_tokens=False` and its stop trimming, the same text it streams). The stored message must be
        exactly what the agent saw, so that the agent's next request, which echoes it, matches the history; a
        second, local decode could differ from the engine's in special-token spacing and would cost CPU per turn.
        """

    @abstractmethod
    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        """The exact inverse of `parse_completion`: the text the model emits for such a reply."""
