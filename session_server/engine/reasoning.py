"""Whether the engine can let a thinking model think before a grammar applies, read from its `/server_info`.

SGLang 0.5.23 holds a request's grammar (a forced tool call's structural tag, a JSON answer's schema) back until the
reasoning ends only when the request says `require_reasoning` (engine/wire.py sends it for a turn in thinking mode)
and the engine runs with `--reasoning-parser`: that flag is what wraps its grammar backend in the gate
(`ReasonerGrammarBackend`, which waits for the parser's think-end token). Without it the grammar applies from the
first token, behind SGLang's own chat server as behind ours, so the model cannot think first. Nothing refuses to run
on such an engine (the tokens are still the engine's own); the operator is told once, at startup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trajectory import ModelFamily


def ungated_grammar_warning(info: Mapping[str, Any], family: ModelFamily) -> str | None:
    """The warning for an engine whose `/server_info` (`info`) says it runs without a reasoning parser while `family`
    reasons, or None: the family never reasons, the engine has a parser, or `info` does not say (a router's own)."""
    if family.thinking_default is None or "reasoning_parser" not in info or info["reasoning_parser"]:
        return None
    return (f"model family {family.name} reasons before it answers, but the engine runs without --reasoning-parser: "
            "a forced tool call or a JSON response format is constrained from the first token, so the model cannot "
            f"think before it (launch SGLang with --reasoning-parser {family.sglang_reasoning_parser} to let it)")
