"""Constrained decoding, emulated: what the sim emits under `json_schema` and `structural_tag` sampling keys.

A real engine masks logits with a grammar (xgrammar), so whatever it samples is in the grammar's language. The sim
cannot sample from a grammar, so it builds one member of the language deterministically from the request's seed:
a JSON instance valid against the schema, or tool calls written with exactly the begin/end strings of the structural
tag. That is what the session server's tests need: a constrained reply parses against its schema, a forced tool
choice yields a call, `stop_after_first` yields one call. Schema features the generator does not cover are a 400
(never a reply that silently breaks the schema); `regex` and `ebnf` are refused the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAX_DEPTH = 12
_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "iris", "juniper", "kernel",
          "lattice", "meadow", "nectar", "orbit", "pepper", "quartz", "river", "signal", "timber", "umber", "vector")


class ConstraintError(ValueError):
    """The request's constraint cannot be emulated (or is malformed): SGLang-style 400."""


@dataclass(frozen=True)
class TagStructure:
    """One tool-call shape of a structural tag: `begin` + JSON arguments + `end`."""

    begin: str
    schema: Any
    end: str


@dataclass(frozen=True)
class StructuralTag:
    structures: tuple[TagStructure, ...]
    triggers: tuple[str, ...]
    at_least_one: bool
    stop_after_first: bool
    # A model-native tag (xgrammar's builtin formats: the tag contents carry a `style`): the calls are written in the
    # family's own format, not as begin + JSON + end.
    native: bool = False


def _json_key(text: str, key: str) -> Any:
    """A sampling key carried as JSON text (SGLang's grammar keys are strings): its value, or a 400 naming the key."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConstraintError(f"{key} is not valid JSON: {exc}") from None


def parse_json_schema(text: str) -> Any:
    schema = _json_key(text, "json_schema")
    if not isinstance(schema, dict | bool):
        raise ConstraintError("json_schema must be a JSON object")
    return schema


_NATIVE_FORMATS = ("tag", "sequence", "tags_with_separator", "optional", "or", "triggered_tags", "const_string",
                   "any_text")


def _native_tag(fmt: dict[str, Any]) -> StructuralTag:
    """A model-native tag (xgrammar's builtin formats, nested): its call tags, whether it forces a call and whether it
    allows only one. The calls are then written in the family's own format, whatever the separators."""
    structures: list[TagStructure] = []
    counts: list[tuple[bool, bool]] = []

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict) or node.get("type") not in _NATIVE_FORMATS:
            raise ConstraintError(f"sglang-sim cannot emulate structural tag node {node!r:.80}")
        if node["type"] == "any_text":  # free text (harmony's final answer): no call
            return
        content = node.get("content")
        if node["type"] == "tag" and isinstance(content, dict) and content.get("type") == "json_schema":
            if not isinstance(node.get("begin"), str):
                raise ConstraintError("each tag needs a string 'begin'")
            schema = content.get("json_schema")
            structures.append(TagStructure(node["begin"], {} if schema is True else schema, str(node.get("end"))))
            return
        if node["type"] in ("triggered_tags", "tags_with_separator"):
            counts.append((bool(node.get("at_least_one")), bool(node.get("stop_after_first"))))
        for key in ("content", "tags", "elements"):
            if isinstance(node.get(key), dict | list):
                visit(node[key])

    visit(fmt)
    if not structures:
        raise ConstraintError("structural_tag has no tool-call tag")
    root = fmt["type"]
    forced = root in ("tag", "sequence") or (root in ("triggered_tags", "tags_with_separator") and counts[0][0])
    # No repeating node (a lone tag, a sequence around one): each tag at most once
    return StructuralTag(tuple(structures), (), forced, not counts or any(stop for _, stop in counts), native=True)


def parse_structural_tag(text: str) -> StructuralTag:
    """SGLang's legacy structural tag (`structures`/`triggers`/`at_least_one`), xgrammar's `triggered_tags` of JSON
    arguments, or a model-native tag of xgrammar's builtin formats."""
    obj = _json_key(text, "structural_tag")
    if not isinstance(obj, dict) or obj.get("type") != "structural_tag":
        raise ConstraintError("structural_tag must be an object with type 'structural_tag'")
    if "structures" in obj:
        items, fmt = obj.get("structures"), obj
        schema_key = "schema"
    else:
        fmt = obj.get("format")
        if not isinstance(fmt, dict):
            raise ConstraintError("structural_tag needs a 'format' object")
        tags = fmt.get("tags")
        if fmt.get("type") != "triggered_tags" or not isinstance(tags, list) or not all(
                isinstance(t, dict) and isinstance(t.get("content"), dict) and "style" not in t["content"]
                and t["content"].get("type", "json_schema") == "json_schema" for t in tags):
            return _native_tag(fmt)
        items, schema_key = tags, "content"
    if not isinstance(items, list) or not items:
        raise ConstraintError("structural_tag needs at least one structure")
    structures = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("begin"), str) or not isinstance(item.get("end"), str):
            raise ConstraintError("each structure needs string 'begin' and 'end'")
        schema = item.get(schema_key) or {}
        if schema_key == "content":
            if not isinstance(schema, dict) or schema.get("type", "json_schema") != "json_schema":
                raise ConstraintError("sglang-sim emulates tag contents of type 'json_schema' only")
            schema = schema.get("json_schema", {})
        structures.append(TagStructure(item["begin"], schema, item["end"]))
    triggers = fmt.get("triggers") or []
    if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        raise ConstraintError("structural_tag triggers must be a list of strings")
    return StructuralTag(tuple(structures), tuple(triggers), bool(fmt.get("at_least_one", False)),
                         bool(fmt.get("stop_after_first", False)))


class _Instance:
    """A deterministic JSON instance of a schema (the subset of JSON Schema agents use for tools and outputs)."""

    def __init__(self, root: Any, rng: np.random.Generator) -> None:
        self.root = root
        self.rng = rng

    def word(self) -> str:
        return _WORDS[int(self.rng.integers(0, len(_WORDS)))]

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#/"):
            raise ConstraintError(f"sglang-sim resolves local $ref only, got {ref!r}")
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise ConstraintError(f"unresolvable $ref {ref!r}")
            node = node[part]
        return node

    def make(self, schema: Any, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise ConstraintError("json_schema nests too deeply for sglang-sim")
        if schema is True or schema == {}:
            return self.word()
        if not isinstance(schema, dict):
            raise ConstraintError("schema nodes must be objects")
        for unsupported in ("not", "pattern", "patternProperties", "if", "dependentSchemas", "contains",
                            "propertyNames", "uniqueItems", "dependentRequired"):
            if schema.get(unsupported) not in (None, False):
                raise ConstraintError(f"sglang-sim cannot emulate the JSON Schema keyword {unsupported!r}")
        if "$ref" in schema:
            return self.make(self.resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ConstraintError("enum must be a non-empty list")
            return values[int(self.rng.integers(0, len(values)))]
        for key in ("anyOf", "oneOf"):
            if key in schema:
                branches = schema[key]
                if not isinstance(branches, list) or not branches:
                    raise ConstraintError(f"{key} must be a non-empty list")
                base = {k: v for k, v in schema.items() if k != key}
                return self.make({**base, **branches[0]} if base else branches[0], depth + 1)
        if "allOf" in schema:
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                if not isinstance(part, dict):
                    raise ConstraintError("allOf entries must be objects")
                props = {**merged.get("properties", {}), **part.get("properties", {})}
                required = [*merged.get("required", []), *part.get("required", [])]
                merged = {**merged, **part, "properties": props, "required": required}
            return self.make(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
        if kind is None:
            kind = ("object" if "properties" in schema else "array" if "items" in schema
                    else "string")
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.number(schema)
        if kind == "boolean":
            return bool(self.rng.integers(0, 2))
        if kind == "null":
            return None
        raise ConstraintError(f"unknown JSON Schema type {kind!r}")

    def object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise ConstraintError("properties must be an object")
        out = {name: self.make(sub, depth + 1) for name, sub in props.items()}
        required = schema.get("required") or []
        extra = schema.get("additionalProperties", True)
        for name in required:
            if name not in out:
                if extra is False:
                    raise ConstraintError(f"required property {name!r} is not allowed by additionalProperties")
                out[name] = self.make(extra if isinstance(extra, dict) else {}, depth + 1)
        if not out and extra is not False and not props:
            out["result"] = self.make(extra if isinstance(extra, dict) else {"type": "string"}, depth + 1)
        lo, hi = schema.get("minProperties", 0), schema.get("maxProperties")
        if len(out) < lo or (hi is not None and len(out) > hi):
            raise ConstraintError("sglang-sim cannot satisfy minProperties/maxProperties for this schema")
        return out

    def array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        lo = int(schema.get("minItems", 0))
        hi = schema.get("maxItems")
        n = max(lo, len(prefix), min(2, hi) if hi is not None else 2)
        if hi is not None:
            n = min(n, int(hi))
        if n < lo or (n < len(prefix) and items is False):
            raise ConstraintError("sglang-sim cannot satisfy the array bounds of this schema")
        out = [self.make(prefix[i], depth + 1) for i in range(min(n, len(prefix)))]
        while len(out) < n:
            if items is False:
                break
            out.append(self.make(items, depth + 1))
        return out

    def string(self, schema: dict[str, Any]) -> str:
        lo = int(schema.get("minLength", 0))
        hi = schema.get("maxLength")
        text = self.word()
        while len(text) < lo:
            text += " " + self.word()
        if hi is not None:
            text = text[: int(hi)]
        if len(text) < lo:
            raise ConstraintError("sglang-sim cannot satisfy minLength/maxLength of this schema")
        return text

    def _bounds(self, schema: dict[str, Any]) -> tuple[float, float]:
        lo, hi = -1000.0, 1000.0
        if "minimum" in schema:
            lo = float(schema["minimum"])
        if "exclusiveMinimum" in schema:
            lo = max(lo, float(schema["exclusiveMinimum"]) + 1e-6)
        if "maximum" in schema:
            hi = float(schema["maximum"])
        if "exclusiveMaximum" in schema:
            hi = min(hi, float(schema["exclusiveMaximum"]) - 1e-6)
        if "minimum" in schema and "maximum" not in schema and "exclusiveMaximum" not in schema:
            hi = lo + 1000.0
        if "maximum" in schema and "minimum" not in schema and "exclusiveMinimum" not in schema:
            lo = hi - 1000.0
        if lo > hi:
            raise ConstraintError("the schema's numeric bounds are empty")
        return lo, hi

    def integer(self, schema: dict[str, Any]) -> int:
        lo, hi = self._bounds(schema)
        step = schema.get("multipleOf", 1)
        if not isinstance(step, int) or step < 1:
            raise ConstraintError("sglang-sim supports integer multipleOf >= 1 only")
        first, last = math.ceil(lo / step), math.floor(hi / step)
        if first > last:
            raise ConstraintError("no integer satisfies the schema's bounds")
        return int(self.rng.integers(first, last + 1)) * step

    def number(self, schema: dict[str, Any]) -> float:
        if "multipleOf" in schema:
            return float(self.integer(schema))
        lo, hi = self._bounds(schema)
        return round(float(self.rng.uniform(lo, hi)), 3) if hi > lo else lo


def json_instance(schema: Any, rng: np.random.Generator) -> Any:
    return _Instance(schema, rng).make(schema)


def json_text(schema: Any, rng: np.random.Generator) -> str:
    """The instance as compact-ish JSON text (`", "`/`": "` separators, like a model writes it)."""
    return json.dumps(json_instance(schema, rng), ensure_ascii=False)


def allowed_calls(tag: StructuralTag, wanted: list[tuple[str, str]], rng: np.random.Generator,
                  name_of: Any) -> list[tuple[TagStructure, str]]:
    """The calls a structural tag lets through: the scripted calls whose tool the tag allows (their arguments when no
    schema constrains them, a schema instance otherwise), at least one when `at_least_one`, one at most when
    `stop_after_first`."""
    by_name: dict[Any, TagStructure] = {}
    for s in tag.structures:
        by_name.setdefault(name_of(s.begin), s)  # harmony writes each tool's header three ways: the first one
    chosen: list[tuple[TagStructure, str]] = []
    for name, arguments in wanted:
        structure = by_name.get(name)
        if structure is None:
            continue
        args = arguments if not structure.schema else json_text(structure.schema, rng)
        chosen.append((structure, args))
    if not chosen and tag.at_least_one:
        structure = tag.structures[0]
        chosen.append((structure, json_text(structure.schema or {"type": "object"}, rng)))
    if tag.stop_after_first:
        chosen = chosen[:1]
    return chosen


def tool_calls_text(tag: StructuralTag, wanted: list[tuple[str, str]], rng: np.random.Generator,
                    name_of: Any) -> str:
    """`allowed_calls`, each written as begin + arguments + end, separated by a newline."""
    return "\n".join(s.begin + args + s.end for s, args in allowed_calls(tag, wanted, rng, name_of))
