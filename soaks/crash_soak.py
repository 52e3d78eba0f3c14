"""Crash soak for --journal (docs/design.md 7): chats, deletes and SIGKILLs; nothing a client received is lost.

Starts a real `sglang-sim` and a real `session-server --journal PATH`, then M agents run multi-turn episodes (each
episode ends with DELETE and a new session) until N chat requests were sent. Every so often the server is killed with
SIGKILL at a random moment -- mid-chat, mid-commit, mid-journal-write, whatever it was doing -- and restarted on the
same journal. After each restart every agent checks its session against what it had received:

- a session whose id a client received (POST /sessions 200) exists; one whose DELETE returned 204 answers 404
  "was deleted";
- every turn the client received with 200 is in the restored trajectory exactly: the records (by rid), and the token
  ids, logprobs and loss mask of the samples, as the server showed them right after that reply;
- at most one turn the client never received (written, then killed before the reply) may follow; the agent retries
  its unanswered request, which rolls that turn back through the normal one-step rollback (counted as repaired).

At the end every session is deleted: the engine's books return to baseline (nothing running, no session, no KV after a
flush, /sim/books ok) and the journal holds no session or turn rows. Reports kills survived, turns checked, turns
repaired, and the journal's size (largest seen during the run and at the end: compaction keeps it bounded).

    python -m soaks.crash_soak --chats 10000 --sessions 32 --kills 20 [--journal-sync full] [--json-out FILE]
    make soak-crash SOAK_ARGS="--chats 10000 --kills 20"

Exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.launchers import RunningProcess, start_session_server, start_sim
from session_server.sessions.journal import SYNC_MODES, file_bytes, table_rows
from sglang_sim import directives
from sglang_sim.baseline import baseline_problems, engine_idle

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CrashReport:
    chats_sent: int = 0
    chats_ok: int = 0
    kills: int = 0
    restarts: int = 0
    sessions_created: int = 0
    sessions_deleted: int = 0
    creates_unanswered: int = 0  # POST /sessions cut by a kill: the session may exist without anyone knowing its id
    turns_checked: int = 0
    turns_repaired: int = 0  # un-received turns found after a restart and rolled back by the agent's retry
    journal_max_bytes: int = 0
    journal_end_bytes: int = 0
    journal_end_rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return "\n".join([
            f"crash soak: {'OK' if self.ok else 'FAILED'} in {self.seconds:.0f}s",
            f"  chats sent {self.chats_sent}, ok {self.chats_ok}; sessions created {self.sessions_created}, "
            f"deleted {self.sessions_deleted}",
            f"  kills survived {self.kills} (restarts {self.restarts}); received turns checked {self.turns_checked}; "
            f"un-received turns repaired by rollback {self.turns_repaired}",
            f"  journal: largest {self.journal_max_bytes / 1024:.0f} KiB during the run, "
            f"{self.journal_end_bytes / 1024:.0f} KiB at the end, rows {self.journal_end_rows}",
            *(f"  FAIL {f}" for f in self.failures[:20]),
        ])


@dataclass
class Snapshot:
    """What the server showed right after the last reply this agent received."""

    rids: list[str]
    tokens: list[int]
    logprobs: list[float]
    mask: list[int]


class Agent:
    def __init__(self, soak: CrashSoak, idx: int) -> None:
        self.soak = soak
        self.rng = random.Random(soak.seed * 1000 + idx)
        self.sid: str | None = None
        self.deleted: list[str] = []  # ids whose DELETE returned 204 (checked after the next restart)
        self.history: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] | None = None  # the request sent without a reply (retried as is)
        self.snapshot: Snapshot | None = None
        self.received: list[str] = []  # rids of the replies this session's client got with 200, in order
        self.turns_left = 0
        self.deleting = False  # a DELETE was sent without a reply: after a restart the session may be gone

    async def create(self, http: httpx.AsyncClient, server: str) -> None:
        self.soak.report.creates_unanswered += 1
        resp = await http.post(f"{server}/sessions", json={"metadata": {"agent": id(self)}})
        if resp.status_code != 200:
            raise httpx.TransportError(f"create: {resp.status_code}")
        self.soak.report.creates_unanswered -= 1
        self.sid = resp.json()["session_id"]
        self.history, self.pending, self.snapshot, self.received = [], None, None, []
        self.turns_left = self.rng.randint(2, 8)
        self.soak.report.sessions_created += 1

    async def take_snapshot(self, http: httpx.AsyncClient, server: str) -> Snapshot:
        info = (await http.get(f"{server}/sessions/{self.sid}")).json()
        samples = (await http.post(f"{server}/sessions/{self.sid}/samples")).json()
        s = samples[0] if samples else {"tokens": [], "rollout_log_probs": [], "loss_mask": []}
        return Snapshot([r["rid"] for r in info["records"]], s["tokens"], s["rollout_log_probs"], s["loss_mask"])

    async def step(self, http: httpx.AsyncClient, server: str) -> None:
        """One action: create, chat (or retry the unanswered chat), or end the episode with DELETE."""
        if self.sid is None:
            await self.create(http, server)
            return
        if self.pending is None and self.turns_left <= 0:
            self.deleting = True
            resp = await http.delete(f"{server}/sessions/{self.sid}")
            if resp.status_code != 204:
                raise httpx.TransportError(f"delete: {resp.status_code}")
            self.deleting = False
            self.deleted.append(self.sid)
            self.soak.report.sessions_deleted += 1
            self.sid = None
            return
        if self.pending is None:
            text = f"step {self.rng.random():.6f} {directives.tokens(self.rng.randint(1, 48))}"
            self.pending = [*self.history, {"role": "user", "content": text}]
        self.soak.report.chats_sent += 1
        resp = await http.post(f"{server}/sessions/{self.sid}/v1/chat/completions", json={"messages": self.pending})
        if resp.status_code != 200:
            raise httpx.TransportError(f"chat: {resp.status_code}")
        body = resp.json()
        self.received.append(body["id"].removeprefix("chatcmpl-"))
        message = body["choices"][0]["message"]
        self.history = [*self.pending, message]
        self.pending = None
        self.turns_left -= 1
        self.soak.report.chats_ok += 1
        self.snapshot = await self.take_snapshot(http, server)

    async def verify(self, http: httpx.AsyncClient, server: str) -> None:
        """After a restart: deleted ids stay deleted, the live session holds every received turn exactly."""
        fail = self.soak.report.failures.append
        for sid in self.deleted:
            gone = await http.get(f"{server}/sessions/{sid}")
            if gone.status_code != 404 or "was deleted" not in gone.text:
                fail(f"deleted session {sid} came back: {gone.status_code} {gone.text[:200]}")
        self.deleted = []
        if self.sid is None:
            return
        resp = await http.get(f"{server}/sessions/{self.sid}")
        if self.deleting:
            self.deleting = False
            if resp.status_code == 404 and "was deleted" in resp.text:  # the tombstone made it to disk
                self.sid = None
                return
        if resp.status_code != 200:
            fail(f"session {self.sid} (id received) lost: {resp.status_code} {resp.text[:200]}")
            self.sid = None
            return
        now = await self.take_snapshot(http, server)
        if now.rids[: len(self.received)] != self.received:
            fail(f"session {self.sid}: received turns {self.received} not kept, restored {now.rids}")
            return
        extra = len(now.rids) - len(self.received)
        if extra > 1 or (extra == 1 and self.pending is None):
            fail(f"session {self.sid}: {extra} turns nobody asked for after the received ones")
        if extra:
            self.soak.report.turns_repaired += 1  # the retry of the pending request rolls it back
        # The tokens as served right after the last reply that had time to be inspected (a kill may have cut that
        # inspection short; later received turns are checked by rid above and by tokens after the next reply).
        was = self.snapshot or Snapshot([], [], [], [])
        trim = 0
        if len(now.rids) > len(was.rids):  # a later turn may have replaced the trimmable tail of that completion
            info = (await http.get(f"{server}/sessions/{self.sid}")).json()
            trim = info["records"][len(was.rids)]["trimmed"]
        keep = len(was.tokens) - trim
        if (now.tokens[:keep] != was.tokens[:keep] or now.mask[:keep] != was.mask[:keep]
                or now.logprobs[:keep] != was.logprobs[:keep]):
            fail(f"session {self.sid}: restored tokens/logprobs/mask differ from what was served")
        if len(now.rids) == len(was.rids) and len(now.tokens) != len(was.tokens):
            fail(f"session {self.sid}: {len(now.tokens) - len(was.tokens)} tokens appeared without a turn")
        self.soak.report.turns_checked += len(self.received)


class CrashSoak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed = args.seed
        self.report = CrashReport()
        self.tok = args.tokenizer or ROOT / ".cache" / "tokenizers" / args.family
        self.journal: Path = args.journal
        self.agents = [Agent(self, i) for i in range(args.sessions)]
        self.rng = random.Random(args.seed)

    def start_server(self, engine: str) -> RunningProcess:
        return start_session_server(
            engine, self.tok, self.args.family, "--journal", str(self.journal), "--journal-sync",
            self.args.journal_sync, log_dir=self.args.log_dir,
        )

    async def round(self, server: RunningProcess, budget: int, kill: bool) -> None:
        """Agents act until `budget` chats were sent; then SIGKILL the server while they are still going."""
        target = self.report.chats_sent + budget
        limits = httpx.Limits(max_connections=len(self.agents) + 4)

        async def run(agent: Agent, http: httpx.AsyncClient) -> None:
            while kill or self.report.chats_sent < target:
                try:
                    await agent.step(http, server.url)
                except httpx.TransportError:
                    return  # the server died (or refused while dying): the unanswered request stays pending

        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(run(a, http)) for a in self.agents]
            if kill:
                while self.report.chats_sent < target and not all(t.done() for t in tasks):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                await asyncio.sleep(self.rng.uniform(0, 0.05))  # land the kill anywhere in a chat
                server.proc.send_signal(signal.SIGKILL)
                self.report.kills += 1
            await asyncio.gather(*tasks)
            self.report.journal_max_bytes = max(self.report.journal_max_bytes, file_bytes(self.journal))

    async def verify_all(self, server: str) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            for agent in self.agents:
                await agent.verify(http, server)

    async def finish(self, server: str, engine: str) -> None:
        fail = self.report.failures.append
        async with httpx.AsyncClient(timeout=60) as http:
            for agent in self.agents:
                if agent.sid is not None and (await http.delete(f"{server}/sessions/{agent.sid}")).status_code != 204:
                    fail(f"final delete of {agent.sid} failed")
            deadline = time.monotonic() + 60  # only a hang fails: a loaded machine may take seconds to go idle
            while True:
                idle = (await http.get(f"{engine}/server_info")).json()
                # DELETE closes engine sessions in the background: wait for them too
                if (engine_idle(idle) and not idle["open_sessions"]) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            flushed = await http.post(f"{engine}/flush_cache")
            after = (await http.get(f"{engine}/server_info")).json()
            books = (await http.get(f"{engine}/sim/books")).json()
            for kind, detail in baseline_problems(idle, flushed.status_code, after, books):
                fail(f"engine not at baseline: {kind}: {detail}")

    def run(self) -> CrashReport:
        started = time.monotonic()
        args = self.args
        sim = start_sim(self.tok, args.family, "--token-latency-ms", str(args.token_latency_ms),
                        "--seed", str(args.seed), log_dir=args.log_dir)
        server: RunningProcess | None = None
        try:
            server = self.start_server(sim.url)
            per_round = max(1, args.chats // (args.kills + 1))
            for k in range(args.kills + 1):
                kill = k < args.kills
                budget = self.rng.randint(per_round // 2, per_round * 3 // 2) if kill else max(
                    1, args.chats - self.report.chats_sent)
                asyncio.run(self.round(server, budget, kill))
                if kill:
                    server.proc.wait(10)
                    server.stop()
                    server = self.start_server(sim.url)
                    self.report.restarts += 1
                    asyncio.run(self.verify_all(server.url))
            asyncio.run(self.finish(server.url, sim.url))
            code = server.stop()
            server = None
            if code != 0:
                self.report.failures.append(f"session-server exited with {code} on SIGTERM")
            self.report.journal_end_rows = table_rows(self.journal)
            rows = self.report.journal_end_rows
            # Only sessions whose creation reply was cut by a kill may remain (nobody knows their ids), never turns.
            if rows["turns"] or rows["sessions"] > self.report.creates_unanswered:
                self.report.failures.append(f"journal rows left after every delete: {rows}")
            self.report.journal_end_bytes = file_bytes(self.journal)
        finally:
            if server is not None:
                server.stop()
            sim.stop()
        self.report.seconds = time.monotonic() - started
        return self.report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="crash_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=2000, help="chat requests to send in total (default 2000)")
    p.add_argument("--sessions", type=int, default=32, help="concurrent agents (default 32)")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs spread over the run (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", default="qwen3", choices=("qwen3", "deepseek"))
    p.add_argument("--tokenizer", type=Path, default=None, help="default .cache/tokenizers/<family>")
    p.add_argument("--token-latency-ms", type=float, default=1.0)
    p.add_argument("--journal", type=Path, default=None, help="journal file (default: a fresh temp file)")
    p.add_argument("--journal-sync", choices=SYNC_MODES, default="normal")
    p.add_argument("--log-dir", type=Path, default=None, help="write the children's output here")
    p.add_argument("--json-out", type=Path, default=None, help="write the report as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.journal is None:
            args.journal = Path(tmp) / "journal.sqlite"
        elif args.journal.exists():
            sys.exit(f"crash_soak: {args.journal} exists; the soak wants a fresh journal")
        args.journal.parent.mkdir(parents=True, exist_ok=True)
        report = CrashSoak(args).run()
    print(report.summary())
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
