"""The model families the suite runs for: every family whose tokenizer scripts/build_tokenizers.py builds offline."""

from __future__ import annotations

from scripts.build_tokenizers import BUILDERS

FAMILIES: tuple[str, ...] = tuple(BUILDERS)
# Families with no tokenizer directory of their own: the family whose vocabulary they use.
SHARED_VOCABULARIES: dict[str, str] = {"qwen3-vl": "qwen3"}
# Every family the `families` fixture binds to a real tokenizer.
BOUND_FAMILIES: tuple[str, ...] = (*FAMILIES, *SHARED_VOCABULARIES)

# Families whose template re-renders a generated turn without reasoning exactly as it was generated, so a TITO prompt
# equals the full render of the conversation. Qwen3.5/3.6 are not: with thinking on the generation prompt opens
# `<think>` and a re-render drops the block from turns before the last user query (renderers' bridge is their oracle).
APPEND_STABLE: tuple[str, ...] = ("qwen3", "deepseek", "deepseek-v4")
# Families whose reply text is exactly what the model generated from an empty start, with JSON tool-call arguments
# and a structural-tag format: the emulated engine's own tests (tests/e2e/test_sim_*.py) read replies that way. The
# others run through the sim in the server's family tests and the demo.
PLAIN_REPLY: tuple[str, ...] = ("qwen3", "deepseek")
# Families whose generation prompt closes the reasoning block unless the request turns thinking on: the model answers
# without reasoning (DeepSeek V4's chat mode, its reference encoder's default).
CHAT_MODE_BY_DEFAULT: tuple[str, ...] = ("deepseek-v4",)
# Families whose model makes one tool call per completion (harmony: `<|call|>` is a stop token): a task that other
# families do with parallel calls takes one model call per tool call.
ONE_CALL_PER_REPLY: tuple[str, ...] = ("gpt-oss",)
# Families whose template writes a generated reply differently in history than the model wrote it (harmony moves a
# call's recipient into the role header; Llama 3.1's template drops the text before a call; Mistral's writes the call
# ids of the history into the call list): TITO keeps the generated tokens, a re-render would differ.
REWRITES_REPLIES: tuple[str, ...] = ("gpt-oss", "llama-3.1", "mistral-nemo")
# Families whose model does not reason.
NO_REASONING: tuple[str, ...] = ("llama-3.1", "mistral-nemo")
# Families whose full render of a later turn differs from the stored ids outside the generated replies too: harmony
# writes a reply as other messages; Mistral's encoder moves the tools and the system prompt to the last user message.
RERENDER_MOVES_GLUE: tuple[str, ...] = ("gpt-oss", "mistral-nemo")
# Families whose template writes the tool schemas before the last user message (Mistral): an appended user turn carries
# them again, where the others write them once in a preamble (`tools_only_in_preamble`).
TOOLS_BEFORE_EACH_QUERY: tuple[str, ...] = ("mistral-nemo",)
# Families whose template joins consecutive assistant messages into one (mistral-common): an assistant message appended
# right after a generated one would rewrite it, which TITO refuses (400); after a user message or tool results it is
# prompt like anywhere else.
MERGES_ASSISTANT_TURNS: tuple[str, ...] = ("mistral-nemo",)
# SGLang's tool-call parser and reasoning parser for each family, as a deployment serving it names them (the reasoning
# parser is the one SGLang suggests for the family's template; None: the model does not reason).
SGLANG_PARSERS: dict[str, tuple[str, str | None]] = {
    "qwen3": ("qwen25", "qwen3"), "deepseek": ("deepseekv3", "deepseek-r1"), "qwen3.5": ("qwen3_coder", "qwen3"),
    "qwen3.6": ("qwen3_coder", "qwen3"), "deepseek-v4": ("deepseekv4", "deepseek-v4"),
    "gpt-oss": ("gpt-oss", "gpt-oss"),
    "llama-3.1": ("llama3", None), "mistral-nemo": ("mistral", None),
}
# Each family's thinking switch and whether a turn is in thinking mode with the switch left out, set true, set false
# (SGLang's `thinking_mode`, which decides `require_reasoning`): written out, not read from the families.
THINKING: dict[str, tuple[str | None, bool, bool, bool]] = {
    "qwen3": ("enable_thinking", True, True, False),
    "qwen3.5": ("enable_thinking", True, True, False),
    "qwen3.6": ("enable_thinking", True, True, False),
    "deepseek": (None, True, True, True),  # R1: always reasons, the template has no switch
    "deepseek-v4": ("thinking", False, True, False),  # chat mode unless `thinking: true`
    "gpt-oss": (None, True, True, True),  # harmony's analysis channel, always
    "llama-3.1": (None, False, False, False),
    "mistral-nemo": (None, False, False, False),
}
