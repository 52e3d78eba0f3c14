"""Three session-server replicas behind the real nginx (Debian package), on the config `deploy.nginx` generates.

Proven here: a session lives on the replica that minted it and every request naming it reaches that replica, by path
or by X-Session-ID; client-chosen ids are placed by consistent hashing, each on one replica; a replica SIGKILLed
mid-run answers 502 through nginx for its sessions only, the others chat on undisturbed, and once it restarts on its
journal its sessions continue exactly where they were; a replica added to a running balancer (config rewritten,
nginx reloaded) takes its share of new sessions and moves no live one; and a reload loses no chat in flight, streamed
or not; and one `session-server-admin` call pauses, continues and reads every replica, naming one that does not
answer; a replica restarted on its journal during a pause comes back paused until that call's continue.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deploy.admin import main as admin_main
from harness.nginx_cluster import LocalCluster
from sglang_sim.directives import tokens
from support.server import chat_url, new_session, sse_events, wait_running
from support.stack import Fleet, FleetFactory

FAMILY = "qwen3"
REPLICAS = 3


@pytest.fixture(scope="module")
def fleet(fleet_factory: FleetFactory) -> Iterator[Fleet]:
    with fleet_factory(family=FAMILY, sims=1, sim_args=["--token-latency-ms", "2"]) as f:
        yield f


@pytest.fixture(scope="module")
def cluster(fleet: Fleet) -> Iterator[LocalCluster]:
    c = LocalCluster(fleet.urls, fleet.tok, FAMILY, fleet.logs / "cluster", server_args=["--create-sessions-on-demand"])
    try:
        c.start(REPLICAS)
        yield c
    finally:
        failures = c.close()
    assert not failures, "\n".join(failures)


def owner(sid: str) -> str:
    return sid.split(".", 1)[0]


def holders(cluster: LocalCluster, sid: str) -> list[str]:
    """The replicas that know `sid`, asked directly (not through nginx)."""
    return [name for name in cluster.procs
            if httpx.get(f"{cluster.replica_url(name)}/sessions/{sid}", timeout=10).status_code == 200]


class Episode:
    """One session's history, chatted through nginx either by its session URL or at the root with X-Session-ID."""

    def __init__(self, base: str, sid: str, *, root: bool = False) -> None:
        self.base, self.sid, self.root = base, sid, root
        self.history: list[dict[str, Any]] = []

    def chat(self, text: str, n: int = 3, **extra: Any) -> httpx.Response:
        self.history.append({"role": "user", "content": f"{text} {tokens(n)}"})
        if self.root:
            url, headers = f"{self.base}/v1/chat/completions", {"X-Session-ID": self.sid}
        else:
            url, headers = chat_url(self.base, self.sid), {}
        r = httpx.post(url, json={"messages": self.history, **extra}, headers=headers, timeout=60)
        if r.status_code == 200:
            self.history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        else:
            self.history.pop()
        return r

    def state(self, base: str | None = None) -> dict[str, Any]:
        r = httpx.get(f"{base or self.base}/sessions/{self.sid}", timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())


def minted(cluster: LocalCluster, n: int) -> list[Episode]:
    return [Episode(cluster.url, new_session(cluster.url)) for _ in range(n)]


def test_sessions_stay_on_the_replica_that_owns_them(cluster: LocalCluster) -> None:
    episodes = minted(cluster, 12)
    by_owner = Counter(owner(e.sid) for e in episodes)
    assert set(by_owner) == set(cluster.replicas) and min(by_owner.values()) >= 2, by_owner  # least_conn spreads
    for turn in range(2):
        for e in episodes:
            assert e.chat(f"turn {turn}").status_code == 200
    for e in episodes:
        assert holders(cluster, e.sid) == [owner(e.sid)]
        assert len(e.state()["records"]) == 2  # both turns reached the owner, through nginx
    # Client-chosen ids at the root URL, created on first use: consistent hashing puts each on one replica.
    chosen = [Episode(cluster.url, f"episode-{i}", root=True) for i in range(12)]
    for turn in range(2):
        for e in chosen:
            assert e.chat(f"turn {turn}").status_code == 200, e.sid
    placed = {e.sid: holders(cluster, e.sid) for e in chosen}
    assert all(len(h) == 1 for h in placed.values()), placed
    assert len({h[0] for h in placed.values()}) >= 2, placed
    for e in chosen:
        assert len(e.state()["records"]) == 2


def test_a_killed_replica_comes_back_on_its_journal_and_disturbs_no_other(cluster: LocalCluster) -> None:
    episodes = minted(cluster, 9)
    for e in episodes:
        assert e.chat("before").status_code == 200
    victim = owner(episodes[0].sid)
    before = {e.sid: e.state() for e in episodes}
    cluster.kill(victim)
    for e in episodes:
        r = e.chat("while down")
        if owner(e.sid) == victim:
            assert r.status_code == 502, r.text  # nginx cannot reach the owner, and tries no other replica
        else:
            assert r.status_code == 200, r.text  # the other replicas' sessions carry on
    created = [new_session(cluster.url) for _ in range(6)]  # new sessions go to the replicas that answer
    assert victim not in {owner(s) for s in created}
    cluster.restart(victim)
    for e in episodes:
        if owner(e.sid) == victim:
            assert e.state() == before[e.sid]  # exactly what was committed before the kill
        assert e.chat("after").status_code == 200
        assert len(e.state()["records"]) == (2 if owner(e.sid) == victim else 3)


def test_an_added_replica_moves_no_live_session(cluster: LocalCluster) -> None:
    episodes = minted(cluster, 9)
    chosen = [Episode(cluster.url, f"live-{i}", root=True) for i in range(9)]
    for e in episodes + chosen:
        assert e.chat("before").status_code == 200
    placed = {e.sid: holders(cluster, e.sid) for e in chosen}
    added = cluster.add_replica()
    for e in episodes + chosen:
        assert e.chat("after").status_code == 200, e.sid  # its owner answered: it holds the first turn
    assert {e.sid: holders(cluster, e.sid) for e in chosen} == placed
    new = Counter(owner(new_session(cluster.url)) for _ in range(40))
    assert set(new) == set(cluster.replicas), new
    assert 5 <= new[added] <= 15, new  # about a quarter
    fresh = [Episode(cluster.url, f"fresh-{i}", root=True) for i in range(8)]
    for e in fresh:
        assert e.chat("first").status_code == 200
        assert holders(cluster, e.sid) != [added]  # the ring is fixed while client-chosen sessions live


RELOAD_TOKENS = 2500


def test_a_reload_loses_no_chat_in_flight(cluster: LocalCluster, fleet: Fleet) -> None:
    episodes = minted(cluster, 4)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            def post(e: Episode, stream: bool) -> Any:
                # 5 s at the engine: all four are running there at once, however slowly they arrive
                body = {"messages": [{"role": "user", "content": f"long {tokens(RELOAD_TOKENS)}"}], "stream": stream}
                return http.post(chat_url(cluster.url, e.sid), json=body)

            chats = [asyncio.ensure_future(post(e, stream=i % 2 == 1)) for i, e in enumerate(episodes)]
            await wait_running(fleet.urls[0], len(episodes))
            # Held at the engine (paused in place) until nginx has reloaded, however fast or slow the machine.
            engine = fleet.urls[0]
            assert (await http.post(f"{engine}/pause_generation", json={"mode": "in_place"})).status_code == 200
            try:
                await asyncio.to_thread(cluster.reload)
                assert not any(c.done() for c in chats), [c.result() for c in chats if c.done()]
            finally:
                assert (await http.post(f"{engine}/continue_generation", json={})).status_code == 200
            return list(await asyncio.gather(*chats))

    replies = asyncio.run(main())
    for i, r in enumerate(replies):
        assert r.status_code == 200, r.text
        if i % 2:
            events = sse_events(r.content)
            assert events[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            assert r.json()["usage"]["completion_tokens"] == RELOAD_TOKENS + 1  # and the stop token
    for e in episodes:
        assert len(e.state()["records"]) == 1


def admin(cluster: LocalCluster, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """`session-server-admin --json ARGS` over every replica: its exit code and its per-replica answers."""
    replicas = [flag for r in cluster.replicas.values() for flag in ("--replica", f"{r.name}={r.address}")]
    code = admin_main([*replicas, "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_one_admin_call_pauses_and_continues_every_replica(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    episodes = {owner(e.sid): e for e in minted(cluster, 3 * len(cluster.replicas))}
    assert set(episodes) == set(cluster.replicas)
    code, health = admin(cluster, capsys, "health")
    assert code == 0 and all(h["ok"] and h["value"]["replica"] == name for name, h in health.items()), health
    code, paused = admin(cluster, capsys, "pause")
    assert code == 0 and {p["value"]["status"] for p in paused.values()} == {"paused"}, paused
    for e in episodes.values():
        r = e.chat("paused")
        assert r.status_code == 503 and r.headers["retry-after"], r.text
    code, metrics = admin(cluster, capsys, "metrics")
    assert code == 0 and all(m["value"]["paused"] == 1 for m in metrics.values()), metrics
    assert admin(cluster, capsys, "continue")[0] == 0
    for e in episodes.values():
        assert e.chat("running").status_code == 200
    code, metrics = admin(cluster, capsys, "metrics")
    assert all(m["value"]["paused"] == 0 and m["value"]["sessions"] >= 3 for m in metrics.values()), metrics
    code, listed = admin(cluster, capsys, "sessions")
    assert code == 0, listed
    for name, answer in listed.items():  # each replica lists exactly the sessions it minted
        ids = {entry["id"] for entry in answer["value"]["sessions"]}
        assert ids and all(owner(i) == name for i in ids if "." in i), (name, ids)
        assert episodes[name].sid in ids and answer["value"]["total"] == metrics[name]["value"]["sessions"]


@pytest.mark.parametrize("mode", ["drain", "in_place"])
def test_a_replica_restarted_during_a_pause_comes_back_paused(
    cluster: LocalCluster, fleet: Fleet, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """A weight update is in progress (every replica paused by one admin call) when a replica is SIGKILLed and
    restarted on its journal: it comes back paused, in the same mode, and refuses chats through nginx until the
    admin plane's continue; the pause ends there, so a later restart comes back running."""
    episodes = {owner(e.sid): e for e in minted(cluster, 3 * len(cluster.replicas))}
    assert set(episodes) == set(cluster.replicas)
    code, paused = admin(cluster, capsys, "pause", "--mode", mode)
    assert code == 0 and {p["value"]["status"] for p in paused.values()} == {"paused"}, paused
    victim = "r1"
    cluster.kill(victim)
    cluster.restart(victim)
    code, health = admin(cluster, capsys, "health")
    assert code == 0 and all(h["value"]["paused"] for h in health.values()), health
    replicas = [flag for r in cluster.replicas.values() for flag in ("--replica", f"{r.name}={r.address}")]
    assert admin_main([*replicas, "health"]) == 0
    table = capsys.readouterr().out
    (line,) = [line for line in table.splitlines() if line.startswith(f"{victim}  ")]
    assert "ok    ok, paused, instance" in line, table
    r = episodes[victim].chat("during the update")
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    if mode == "in_place":  # the restarted replica knows the engine is paused by it, and resumes it on continue
        engine = fleet.urls[0]
        assert httpx.get(f"{engine}/server_info", timeout=10).json()["paused"]
        assert httpx.post(f"{cluster.replica_url(victim)}/admin/continue", timeout=30).status_code == 200
        assert not httpx.get(f"{engine}/server_info", timeout=10).json()["paused"]
    assert admin(cluster, capsys, "continue")[0] == 0
    for e in episodes.values():
        assert e.chat("after the update").status_code == 200, e.sid
    cluster.kill(victim)
    cluster.restart(victim)
    assert episodes[victim].chat("after a restart").status_code == 200


def test_a_replica_that_does_not_answer_is_named(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster.kill("r0")
    try:
        code, paused = admin(cluster, capsys, "pause", "--mode", "abort")
        assert code == 1
        assert not paused["r0"]["ok"] and paused["r0"]["error"].startswith("unreachable"), paused["r0"]
        assert all(p["ok"] for name, p in paused.items() if name != "r0"), paused
        assert admin(cluster, capsys, "continue")[0] == 1
        replicas = [flag for r in cluster.replicas.values() for flag in ("--replica", f"{r.name}={r.address}")]
        assert admin_main([*replicas, "health"]) == 1
        table = capsys.readouterr().out
        assert f"r0  {cluster.replicas['r0'].address}  FAIL  unreachable" in table, table
        assert f"{len(cluster.replicas) - 1}/{len(cluster.replicas)} replicas ok; failed: r0" in table, table
    finally:
        cluster.restart("r0")
    # A replica listed under another name than its own --replica-name would get the wrong ids from nginx.
    swapped = [f"r0={cluster.replicas['r1'].address}", f"r1={cluster.replicas['r0'].address}"]
    assert admin_main(["--replica", swapped[0], "--replica", swapped[1], "--json", "health"]) == 1
    answers = json.loads(capsys.readouterr().out)
    assert "answers as replica 'r1', not 'r0'" in answers["r0"]["error"], answers


def fork_through(cluster: LocalCluster, sid: str, **body: Any) -> list[str]:
    r = httpx.post(f"{cluster.url}/sessions/{sid}/fork", json=body, timeout=30)
    assert r.status_code == 200, r.text
    children: list[str] = r.json()["session_ids"]
    return children


def test_a_forks_children_live_on_their_parents_replica(cluster: LocalCluster) -> None:
    """The fork is served by the parent's replica (its id routes there), which mints the children with its own name:
    each child is held there alone and every request naming it -- by path or X-Session-ID -- reaches it through nginx.
    Holds for a minted parent, for a client-chosen one (placed by hashing: its children are minted, not hashed), and
    for a GRPO group forked at a primed prompt."""
    minted_parent = Episode(cluster.url, new_session(cluster.url))
    chosen_parent = Episode(cluster.url, "fork-parent-7", root=True)
    for parent in (minted_parent, chosen_parent):
        assert parent.chat("first").status_code == 200
        (home,) = holders(cluster, parent.sid)
        children = fork_through(cluster, parent.sid, n=3)
        assert {owner(c) for c in children} == {home}
        for i, child in enumerate(children):
            assert holders(cluster, child) == [home]
            episode = Episode(cluster.url, child, root=i == 0)
            episode.history = list(parent.history)
            assert episode.chat(f"branch {i}").status_code == 200
            assert len(episode.state()["records"]) == 2  # the parent's turn, then its own, on the parent's replica
    group_parent = new_session(cluster.url)
    prompt = [{"role": "user", "content": f"a group's prompt {tokens(2)}"}]
    primed = httpx.post(f"{cluster.url}/sessions/{group_parent}/prime", json={"messages": prompt}, timeout=30)
    assert primed.status_code == 200, primed.text
    group = fork_through(cluster, group_parent, n=4)
    assert {owner(c) for c in group} == {owner(group_parent)}
    for child in group:
        assert httpx.post(chat_url(cluster.url, child), json={"messages": prompt}, timeout=60).status_code == 200
        assert holders(cluster, child) == [owner(group_parent)]
