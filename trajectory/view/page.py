"""The page: one HTML file with the stylesheet and the script inlined (no build step, no CDN, nothing fetched but
the document), in three modes: the server's session list, the server's session (both fetch their JSON from a path
relative to the page, so they work behind a path prefix) and the offline page (the document embedded)."""

from __future__ import annotations

import functools
import html
import json
from importlib import resources
from typing import Any


@functools.cache
def _asset(name: str) -> str:
    return resources.files("trajectory.view").joinpath("assets", name).read_text(encoding="utf-8")


def _page(mode: str, title: str, source: str, doc: str) -> str:
    return (_asset("view.html")
            .replace("{{title}}", html.escape(title))
            .replace("{{mode}}", mode)
            .replace("{{source}}", html.escape(source, quote=True))
            .replace("{{style}}", _asset("view.css"))
            .replace("{{script}}", _asset("view.js"))
            .replace("{{doc}}", doc))


def embedded_json(value: Any) -> str:
    """JSON safe inside a <script> element: no '<' can end it early ('<' only occurs inside JSON strings)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def list_page() -> str:
    """/view/: the live sessions, from `api/sessions` beside it."""
    return _page("list", "sessions", "api/sessions", "null")


def session_page(session_id: str) -> str:
    """/view/sessions/{id}: that session, from `../api/sessions/{id}`."""
    return _page("session", f"session {session_id}", f"../api/sessions/{session_id}", "null")


def offline_page(doc: dict[str, Any]) -> str:
    """One self-contained file: the document embedded."""
    return _page("doc", str(doc.get("title", "trajectory")), "", embedded_json(doc))
