"""The model families the suite runs for: every family whose tokenizer scripts/build_tokenizers.py builds offline."""

from __future__ import annotations

from scripts.build_tokenizers import BUILDERS

FAMILIES: tuple[str, ...] = tuple(BUILDERS)

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
# call's recipient into the role header; Llama 3.1's template drops the text before a call): TITO keeps the generated
# tokens, a re-render would differ.
REWRITES_REPLIES: tuple[str, ...] = ("gpt-oss", "llama-3.1")
# Families whose model does not reason.
NO_REASONING: tuple[str, ...] = ("llama-3.1",)
