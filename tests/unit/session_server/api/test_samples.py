"""session_server.api.samples over the real app in process: POST /sessions/{id}/samples.

A session with real committed turns on two segments (the real Qwen3 tokenizer) is read back through both encodings
with the trainer's own decoders, truncated by `max_seq_len`, and read while a commit holds the session lock (the
snapshot must wait for it, never see half a turn).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from session_server.api.samples import OCTET_STREAM
from session_server.errors import AbortReason
from session_server.sessions.session import Session
from support.bounded import bounded, user
from support.inprocess_app import client_of, in_process_app
from support.tito import Reply, generate
from trajectory import ModelFamily, samples_from_json, samples_from_safetensors


def turn(session: Session, request: list[dict[str, Any]], text: str) -> None:
    segments = session.segments
    plan = segments.reserve(segments.prepare(request, busy={}))
    segments.commit(plan, *generate(segments.main.family, plan.turn, Reply(text), rid=f"rid-{text}"))


def test_one_sample_per_segment_in_both_encodings(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            session = server.lifecycle.create(server.new_segments())
            url = f"/sessions/{session.id}/samples"
            async with client_of(app) as http:
                empty = await http.post(url)
                assert (empty.status_code, empty.json()) == (200, [])  # before the first turn
                turn(session, [user("solve")], "first")
                turn(session, [*session.trajectory.messages, user("more")], "second")
                turn(session, [user("a side request")], "side")
                as_json = await http.post(url)
                as_binary = await http.post(url, headers={"accept": OCTET_STREAM}, json={"max_seq_len": None})
            assert as_json.headers["content-type"] == "application/json"
            assert as_binary.headers["content-type"] == OCTET_STREAM
            decoded, binary = samples_from_json(as_json.json()), samples_from_safetensors(as_binary.content)
            trajectories = [session.segments.get(i).trajectory for i in (0, 1)]
            for samples in (decoded, binary):
                assert [s.metadata.get("segment") for s in samples] == [0, 1]
                for sample, traj in zip(samples, trajectories, strict=True):
                    assert sample.tokens.tolist() == traj.token_ids.tolist()
                    assert sample.loss_mask.tolist() == traj.loss_mask.tolist()
                    assert np.allclose(sample.rollout_log_probs, traj.logprobs)
                    assert sample.status == "completed"
            assert int(decoded[0].loss_mask.sum()) == sum(r.completion_len for r in trajectories[0].records)

    asyncio.run(main())


def test_max_seq_len_truncates_and_is_validated(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            session = server.lifecycle.create(server.new_segments())
            turn(session, [user("solve")], "first")
            turn(session, [*session.trajectory.messages, user("more")], "second")
            url = f"/sessions/{session.id}/samples"
            n = session.trajectory.num_tokens
            async with client_of(app) as http:
                cut = samples_from_json((await http.post(url, json={"max_seq_len": n - 3})).json())
                whole = samples_from_json((await http.post(url, json={"max_seq_len": n})).json())
                bad = [await http.post(url, json={"max_seq_len": v}) for v in (0, -1, "5", 5.5, True, 2**31)]
                not_object = await http.post(url, content=b"[]")
            assert len(cut[0].tokens) <= n - 3 and cut[0].status == "truncated"
            assert len(whole[0].tokens) == n and whole[0].status == "completed"
            for reply in bad:
                assert reply.status_code == 400 and "max_seq_len" in reply.text
            assert not_object.status_code == 400

    asyncio.run(main())


def test_unknown_and_deleted_sessions_are_404(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            session = server.lifecycle.create(server.new_segments())
            await bounded(server.lifecycle.close(session, AbortReason.DELETE))
            async with client_of(app) as http:
                unknown = await http.post("/sessions/" + "f" * 32 + "/samples")
                deleted = await http.post(f"/sessions/{session.id}/samples")
            assert unknown.status_code == 404
            assert deleted.status_code == 404 and "was deleted" in deleted.text

    asyncio.run(main())


def test_the_snapshot_waits_for_a_commit_that_holds_the_session_lock(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            session = server.lifecycle.create(server.new_segments())
            turn(session, [user("solve")], "first")
            async with client_of(app) as http:
                async with session.lock:  # a commit in progress
                    reading = asyncio.create_task(http.post(f"/sessions/{session.id}/samples"))
                    await asyncio.sleep(0.05)
                    assert not reading.done()
                    turn(session, [*session.trajectory.messages, user("more")], "second")
                reply = await bounded(reading)
            sample = samples_from_json(reply.json())[0]
            assert sample.tokens.tolist() == session.trajectory.token_ids.tolist()  # both turns, never half

    asyncio.run(main())
