"""Process counters for /metrics (Prometheus text format). Plain ints mutated on the loop: no locks needed."""

from __future__ import annotations

from collections import Counter

from trajectory.messages import ROLLBACK_REASONS


class Metrics:
    def __init__(self) -> None:
        self.chats_by_status: Counter[int] = Counter()
        self.engine_aborts = 0
        self.sessions_created = 0
        self.sessions_deleted = 0  # by DELETE
        self.sessions_expired = 0  # by the idle sweep
        # Committed turns that dropped checkpoints, by reason; every reason is exported from the start (at 0).
        self.rollbacks_by_reason: Counter[str] = Counter(dict.fromkeys(ROLLBACK_REASONS, 0))

    def chat(self, status: int) -> None:
        self.chats_by_status[status] += 1

    def render(self, *, in_flight: int, sessions: int, tombstones: int, paused: bool) -> str:
        ok = sum(n for s, n in self.chats_by_status.items() if s < 400)
        err = sum(n for s, n in self.chats_by_status.items() if s >= 400)
        lines = [
            "# TYPE session_server_chats_total counter",
            f'session_server_chats_total{{result="ok"}} {ok}',
            f'session_server_chats_total{{result="error"}} {err}',
            "# TYPE session_server_chats_by_status_total counter",
            *(
                f'session_server_chats_by_status_total{{status="{s}"}} {n}'
                for s, n in sorted(self.chats_by_status.items())
            ),
            "# TYPE session_server_engine_aborts_total counter",
            f"session_server_engine_aborts_total {self.engine_aborts}",
            "# TYPE session_server_sessions_created_total counter",
            f"session_server_sessions_created_total {self.sessions_created}",
            "# TYPE session_server_sessions_deleted_total counter",
            f"session_server_sessions_deleted_total {self.sessions_deleted}",
            "# TYPE session_server_sessions_expired_total counter",
            f"session_server_sessions_expired_total {self.sessions_expired}",
            "# TYPE session_server_rollbacks_total counter",
            *(
                f'session_server_rollbacks_total{{reason="{r}"}} {n}'
                for r, n in sorted(self.rollbacks_by_reason.items())
            ),
            "# TYPE session_server_in_flight gauge",
            f"session_server_in_flight {in_flight}",
            "# TYPE session_server_sessions gauge",
            f"session_server_sessions {sessions}",
            "# TYPE session_server_tombstones gauge",
            f"session_server_tombstones {tombstones}",
            "# TYPE session_server_paused gauge",
            f"session_server_paused {int(paused)}",
        ]
        return "\n".join(lines) + "\n"
