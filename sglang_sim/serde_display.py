"""serde's `Unexpected` display of a JSON value: SGLang's Rust request gate names a wrongly typed field's value this way
in its 400 texts ("invalid type: integer `5`, expected ..."), and the sim's texts must read the same."""

from __future__ import annotations

from typing import Any


def unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__
