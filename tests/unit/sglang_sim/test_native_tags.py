"""sglang-sim reads the model-native structural tags the session server sends (session_server/frontend/tool_grammar.py)
as the grammar means them: which tools it allows, whether it forces a call, whether it allows only one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from session_server.frontend.tool_grammar import BUILDERS, native_structural_tag
from sglang_sim.constraints import allowed_calls, parse_structural_tag
from sglang_sim.generation import _NATIVE_NAME

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
    "k": {"type": "string"}}, "required": ["k"]}}} for n in ("add", "lookup")]


def _name(begin: str) -> str | None:
    match = _NATIVE_NAME.search(begin)
    return match.group(1) if match else None


@pytest.mark.parametrize("model", BUILDERS)
@pytest.mark.parametrize(("named", "required", "parallel"), [
    (None, True, True), (None, True, False), ("lookup", True, True), ("lookup", True, False), (None, False, False)])
def test_the_sim_reads_each_native_tag(model: str, named: str | None, required: bool, parallel: bool) -> None:
    tag = parse_structural_tag(json.dumps(native_structural_tag(model, TOOLS, named, required, parallel)))
    assert tag.native
    assert {_name(s.begin) for s in tag.structures} == ({named} if named else {"add", "lookup"})
    assert tag.at_least_one == required
    # one call at most: parallel calls off, or a named tool in a format that writes it once (Qwen XML, DSML)
    assert tag.stop_after_first == (not parallel or (named is not None and model != "harmony"))
    rng = np.random.default_rng(0)
    wanted = [("add", '{"k": "a"}'), ("lookup", '{"k": "b"}')]
    calls = [(_name(s.begin), json.loads(args)) for s, args in allowed_calls(tag, wanted, rng, _name)]
    expected = [n for n, _ in wanted if named in (None, n)]
    assert [n for n, _ in calls] == (expected[:1] if tag.stop_after_first else expected)
    assert all(isinstance(args["k"], str) for _, args in calls)  # the schema's instance: the grammar writes them
    if required:  # no scripted call: the grammar still forces one, its arguments an instance of the schema
        ((_, args),) = allowed_calls(tag, [], rng, _name)[:1]
        assert isinstance(json.loads(args)["k"], str)
