"""Reading the lists of objects the Responses and Anthropic requests are made of, with 400s that name the field in
the API's own terms (`input[3].call_id`, `messages[1].content[0].type`), so a client -- Claude Code drops a feature
per 400 and retries -- can tell exactly what was refused. Pure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from trajectory.errors import RequestValidationError


def bad(field_name: str, why: str) -> RequestValidationError:
    return RequestValidationError(f"'{field_name}' {why}")


def objects(value: Any, field_name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`field[i]`, item) for a list of objects; anything else in it, or a value that is not a list, is a 400."""
    if not isinstance(value, list):
        raise bad(field_name, "must be a list")
    for i, item in enumerate(value):
        where = f"{field_name}[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object")
        yield where, item


def non_empty_string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key}", "must be a non-empty string")
    return value
