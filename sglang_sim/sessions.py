"""Engine sessions: how `session_params` turns a short `input_ids` into the full prompt, per SGLang's rules.

Two kinds, as in SGLang's session controller:
- non-streaming sessions keep a tree of finished requests by rid; a request may append to any of them (`rid`),
  cut it (`offset`), drop its output (`drop_previous_output`) or replace its subtree (`replace`);
- streaming sessions are append-only with one request in flight, and keep the KV of their last good turn in a slot
  (`KVHold`) so the next turn prefills only the new tokens. The slot is handed to the running request and comes
  back only when it finishes well; an abort loses it (the next turn re-prefills from the last good turn), a refused
  request never touches it.
Refusals raise `SessionRefusal` with SGLang's message; the HTTP layer turns them into 400s.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sglang_sim.generation import SamplingParams
from sglang_sim.radix_cache import Node

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class SessionParams:
    """A request's `session_params`, as SGLang's session controller reads them."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class SimRequest(Protocol):
    """What a session needs of a request (the scheduler's `requests.SimRequest` has it): sessions sit below requests."""

    prompt: np.ndarray

    @property
    def rid(self) -> str: ...

    @property
    def params(self) -> SamplingParams: ...


class SessionRefusal(Exception):
    """The session cannot take this request (SGLang aborts it with a 400 before it runs)."""


@dataclass
class KVHold:
    """KV a streaming session keeps between turns: a locked radix prefix plus slots only it owns."""

    node: Node
    prefix_len: int
    private: np.ndarray

    @property
    def length(self) -> int:
        return self.prefix_len + len(self.private)


@dataclass(eq=False)
class TurnNode:
    """One request of a non-streaming session: what it was given and what it produced."""

    rid: str
    prompt: np.ndarray
    output: np.ndarray
    max_new_tokens: int
    request: SimRequest | None
    parent: TurnNode | None = None
    children: list[TurnNode] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.request is None

    def subtree(self) -> list[TurnNode]:
        out = [self]
        for child in self.children:
            out.extend(child.subtree())
        return out


@dataclass(eq=False)
class EngineSession:
    """State of one `/open_session` id."""

    session_id: str
    capacity_of_str_len: int
    streaming: bool
    timeout: float | None
    last_active: float = field(default_factory=time.monotonic)
    close_on_finish: bool = False
    # streaming sessions
    history: np.ndarray = field(default_factory=lambda: _EMPTY)
    hold: KVHold | None = None
    inflight: SimRequest | None = None
    # non-streaming sessions
    nodes: dict[str, TurnNode] = field(default_factory=dict)

    @classmethod
    def open(cls, session_id: str | None, capacity_of_str_len: int, streaming: bool,
             timeout: float | None) -> EngineSession:
        return cls(session_id=session_id or uuid.uuid4().hex, capacity_of_str_len=capacity_of_str_len,
                   streaming=streaming, timeout=timeout)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def timed_out(self, now: float) -> bool:
        return self.timeout is not None and now - self.last_active > self.timeout

    def busy(self) -> bool:
        if self.streaming:
            return self.inflight is not None
        return any(not node.finished for node in self.nodes.values())

    # -- prompt construction --------------------------------------------------------------------------------------

    def build_prompt(self, params: SessionParams, input_ids: np.ndarray, bos_id: int | None) -> np.ndarray:
        """The full prompt of a request on this session; raises SessionRefusal without changing any state."""
        self.touch()
        if self.close_on_finish:
            raise SessionRefusal(f"Invalid request: close was requested for session {self.session_id}")
        if self.streaming:
            return self._streaming_prompt(params, input_ids, bos_id)
        return self._tree_prompt(params, input_ids, bos_id)

    def _streaming_prompt(self, params: SessionParams, input_ids: np.ndarray, bos_id: int | None) -> np.ndarray:
        if self.inflight is not None:
            raise SessionRefusal("Streaming session already has an active request.")
        if params.replace:
            raise SessionRefusal("Streaming sessions do not support replace.")
        if params.drop_previous_output:
            raise SessionRefusal("Streaming sessions do not support drop_previous_output.")
        if params.offset:
            raise SessionRefusal("Streaming sessions do not support offset.")
        if len(self.history) == 0:
            return input_ids
        return np.concatenate([self.history, _strip_bos(input_ids, bos_id)])

    def _tree_prompt(self, params: SessionParams, input_ids: np.ndarray, bos_id: int | None) -> np.ndarray:
        last = None
        if params.rid is not None:
            last = self.nodes.get(params.rid)
            if last is None:
                raise SessionRefusal("Invalid request session id")
            if not params.replace and not last.finished:
                raise SessionRefusal("Session request is appending to a request that hasn't finished.")
        if last is None:
            return input_ids
        base = last.prompt if params.drop_previous_output else np.concatenate(
            [last.prompt, last.output[: last.max_new_tokens]])
        new = _strip_bos(input_ids, bos_id)
        if params.offset:
            base = base[: params.offset]
        return np.concatenate([base, new])

    def attach(self, request: SimRequest, params: SessionParams) -> list[SimRequest]:
        """Record an accepted request; returns requests that `replace` orphaned (the caller aborts them)."""
        if self.streaming:
            self.inflight = request
            return []
        orphans: list[SimRequest] = []
        parent = None
        if params.replace:
            if params.rid is None:
                roots = [n for n in self.nodes.values() if n.parent is None]
                for root in roots:
                    orphans.extend(self._drop(root))
            else:
                parent = self.nodes[params.rid]
                if parent.request is not None:
                    orphans.append(parent.request)
                for child in list(parent.children):
                    orphans.extend(self._drop(child))
                parent.children.clear()
        elif params.rid is not None:
            parent = self.nodes[params.rid]
        node = TurnNode(rid=request.rid, prompt=request.prompt, output=_EMPTY,
                        max_new_tokens=request.params.max_new_tokens, request=request, parent=parent)
        if parent is not None:
            parent.children.append(node)
        self.nodes[request.rid] = node
        return orphans

    def _drop(self, node: TurnNode) -> list[SimRequest]:
        orphans = []
        for n in node.subtree():
            self.nodes.pop(n.rid, None)
            if n.request is not None:
                orphans.append(n.request)
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)
        return orphans

    def on_request_end(self, request: SimRequest, output: np.ndarray, succeeded: bool) -> None:
        """Bookkeeping when a request of this session ends (the KV side is the scheduler's)."""
        self.touch()
        if self.streaming:
            if self.inflight is request:
                self.inflight = None
            if succeeded:
                self.history = np.concatenate([request.prompt, output])
            return
        node = self.nodes.get(request.rid)
        if node is not None and node.request is request:
            node.output = output
            node.request = None


def _strip_bos(ids: np.ndarray, bos_id: int | None) -> np.ndarray:
    """An appended turn must not restart the sequence: SGLang trims a leading BOS."""
    if bos_id is not None and len(ids) and int(ids[0]) == bos_id:
        return ids[1:]
    return ids
