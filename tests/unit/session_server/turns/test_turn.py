"""Request ids (session_server/turns/turn.py `new_rid`): fixed-length hex, and distinct where they are cut short.

A turn's tool-call ids are `call_` + the first 24 digits of its rid (turns/output.py), so those must differ between
turns, not only the whole ids; and no id may be a prefix of another (the engine's abort matches by prefix)."""

from __future__ import annotations

import string

from session_server.turns.output import call_id_prefix
from session_server.turns.turn import new_rid


def test_rids_are_fixed_length_hex_and_distinct_in_their_first_24_digits() -> None:
    rids = [new_rid() for _ in range(10_000)]
    assert all(len(rid) == 32 and set(rid) <= set(string.hexdigits.lower()) for rid in rids)
    assert len({call_id_prefix(rid) for rid in rids}) == len(rids)
