"""Replies are written in one piece: writes made in one loop pass reach the socket as one write, in order."""

from __future__ import annotations

import asyncio
from typing import Any

from session_server.http.limits import _GATHER_BELOW, _CoalescingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, pieces: list[bytes]) -> None:
        self.writes.append(b"|".join(pieces))  # marks that the pieces were not joined by us

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def _with_transport() -> tuple[FakeTransport, _CoalescingTransport]:
    fake = FakeTransport()
    return fake, _CoalescingTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]


def test_head_and_body_of_one_pass_are_one_write() -> None:
    async def main() -> None:
        fake, t = await _with_transport()
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.write(b"body")
        assert fake.writes == [] and t.get_write_buffer_size() == len(b"HTTP/1.1 200 OK\r\n\r\nbody")
        await asyncio.sleep(0)
        assert fake.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        t.write(b"next")
        await asyncio.sleep(0)
        assert fake.writes[-1] == b"next"
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # everything else is the real transport's

    asyncio.run(main())


def test_close_writes_what_is_held_and_abort_drops_it() -> None:
    async def main() -> None:
        fake, t = await _with_transport()
        t.write(b"431 reply")
        t.close()
        assert fake.writes == [b"431 reply"] and fake.closed
        await asyncio.sleep(0)
        assert fake.writes == [b"431 reply"]  # nothing written twice, nothing after close

        fake, t = await _with_transport()
        t.write(b"half")
        t.abort()
        await asyncio.sleep(0)
        assert fake.writes == [] and fake.aborted

    asyncio.run(main())


def test_large_pieces_are_not_copied_into_one() -> None:
    async def main() -> None:
        fake, t = await _with_transport()
        big = b"x" * _GATHER_BELOW
        t.write(b"head")
        t.write(big)
        await asyncio.sleep(0)
        assert fake.writes == [b"head|" + big]

    asyncio.run(main())
