"""The journal's crash soak (soaks/crash_soak.py) in a small configuration: real processes, SIGKILLs at random
points, restarts on the same journal; every turn a client received is restored exactly, deleted ids stay deleted,
un-received turns are repaired by the retry's rollback, the engine's books return to baseline and every deleted
session's rows are compacted away."""

from __future__ import annotations

from pathlib import Path

import pytest

from soaks.crash_soak import CrashSoak, parse_args


@pytest.mark.slow
def test_crash_soak_survives_kills(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    args = parse_args(["--chats", "400", "--sessions", "12", "--kills", "3", "--seed", "5",
                       "--tokenizer", str(tokenizer_dirs["qwen3"]), "--journal", str(tmp_path / "j.sqlite"),
                       "--log-dir", str(tmp_path)])
    report = CrashSoak(args).run()
    print(report.summary())
    assert report.ok, report.summary()
    assert report.kills == 3 and report.restarts == 3
    assert report.turns_checked > 0 and report.sessions_deleted > 0
    assert report.journal_end_rows["turns"] == 0
