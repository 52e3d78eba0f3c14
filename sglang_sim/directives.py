"""The `[[sim: ...]]` directive syntax, in one place: how a prompt scripts the emulated engine's reply.

A message may carry any of `[[sim: think]]` (a reasoning block), `[[sim: reply TEXT]]` (a fixed answer),
`[[sim: tokens N]]` (N tokens of seeded words) and `[[sim: tool_call name=NAME args=JSON]]` (repeat it for parallel
calls). The engine reads the directives of the last message that has any (generation.find_script); the builders
here are what the rollout scripts, the soak and the benchmarks use to write them.
"""

from __future__ import annotations

import json
import re
from typing import Any

MARK = "[[sim:"
PATTERN = re.compile(r"\[\[sim:\s*(tool_call|think|reply|tokens)\b")
THINK = "[[sim: think]]"


def tool_call(name: str, **args: Any) -> str:
    return f"[[sim: tool_call name={name} args={json.dumps(args)}]]"


def reply(text: str) -> str:
    return f"[[sim: reply {text}]]"


def tokens(n: int) -> str:
    return f"[[sim: tokens {n}]]"
