"""The framing of an engine stream: the body's bytes, as the HTTP parser hands them over, into whole server-sent
events (the data after `data: `), up to SGLang's `data: [DONE]`.

Why a module of its own: what an event means (engine/reader.py) and when its text goes out (engine/chunker.py) do
not depend on how the body was cut into reads, and this is the one place that knows. SGLang writes each event as one
HTTP chunk (`data: <json>\\n\\n`, the JSON holding no line break) and the lean client hands a chunked body over one
piece per HTTP chunk (engine/http11.py), so on the hot path an event is a piece and its payload a view of it: a
check of its start and a `memchr` for its line ends (JSON holds none), no copy (a cumulative event is the whole reply
so far, hundreds of kilobytes). Anything else -- an event cut across pieces or several in one (a proxy's own
chunks, httpx's reads), CR LF or CR line ends, comments, several `data:` lines -- is read by the SSE rules, each byte
searched once.
"""

from __future__ import annotations

_DONE = b"[DONE]"
_DONE_PIECE = b"data: [DONE]\n\n"  # as SGLang writes it, one HTTP chunk

Payload = bytes | memoryview  # an event's data; msgspec decodes either


class Frames:
    """Whole events out of the body's pieces: `feed` each read's pieces, then `close` at the body's end. `done` once
    `[DONE]` was read (nothing after it is)."""

    __slots__ = ("_carry", "_cr", "_rest", "done")

    def __init__(self) -> None:
        self._carry = b""  # SGLang's framing: a piece a read cut short, its rest to come first in the next read
        self._rest = b""  # the start of an event a read cut short, its line ends made `\n`
        self._cr = False  # the last byte read was a CR whose LF may come next (held back until then)
        self.done = False

    def feed(self, pieces: list[bytes]) -> list[Payload]:
        """The payloads of the events these pieces complete, in order."""
        if self.done or not pieces:
            return []
        if self._carry:  # the start of an event whose rest begins this read (a read ended inside an HTTP chunk)
            pieces = [self._carry + pieces[0], *pieces[1:]]
            self._carry = b""
        if not self._rest and not self._cr:
            carry = pieces[-1] if b"\n" not in pieces[-1] and b"\r" not in pieces[-1] else b""
            n = len(pieces) - (1 if carry else 0)
            n_events = n - 1 if n and pieces[n - 1] == _DONE_PIECE else n
            whole: list[Payload] = [memoryview(p)[6:-2] for p in pieces[:n_events]
                                    if p.startswith(b"data: {") and p.endswith(b"\n\n") and p.find(b"\n") == len(p) - 2
                                    and b"\r" not in p]
            if len(whole) == n_events:  # SGLang's own framing: every piece one event
                self.done = n_events < n
                self._carry = b"" if self.done else carry
                return whole
        return self._search(b"".join(pieces))

    def close(self) -> list[Payload]:
        """At the body's end: the event of the whole lines left (an engine may end its last event with one line
        break only); a line cut short is not an event."""
        if self.done:
            return []
        if self._carry:
            self._search(self._carry)
            self._carry = b""
        rest = self._rest + (b"\n" if self._cr else b"")
        self._rest, self._cr = b"", False
        return self._events(rest[: rest.rfind(b"\n") + 1])

    def _search(self, data: bytes) -> list[Payload]:
        """Any framing: line ends made `\\n` (a CR at the end waits for the LF that may follow it), the complete
        events cut at the last blank line, the rest kept for the next read. Only the new bytes are searched."""
        if self._cr:
            data = b"\r" + data
        self._cr = data.endswith(b"\r")
        if self._cr:
            data = data[:-1]
        new = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = max(0, len(self._rest) - 1)
        text = self._rest + new
        end = text.rfind(b"\n\n", start)
        if end < 0:
            self._rest = text
            return []
        self._rest = text[end + 2:]
        return self._events(text[: end + 2])

    def _events(self, text: bytes) -> list[Payload]:
        """The payloads of the events in `text` (line ends `\\n`), by the SSE rules: a blank line (or the text's
        end) ends an event, its `data:` lines joined by line breaks are its payload, comments and other fields
        are skipped. Stops at `[DONE]`."""
        out: list[Payload] = []
        for block in text.split(b"\n\n"):
            lines = [line[6:] if line.startswith(b"data: ") else line[5:]
                     for line in block.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                continue
            payload = b"\n".join(lines)
            if payload.strip() == _DONE:
                self.done = True
                self._rest, self._cr = b"", False
                break
            out.append(payload)
        return out
