"""The trajectory viewer's page and the document it renders, shared by the server's `/view/` routes and the offline
`python -m rollout.view` (docs/viewer.md).

One renderer for both: a static HTML + JS + CSS page (assets/, shipped as package data, no build step, no CDN) that
draws a *view document*, JSON describing a session's or a sample file's trajectory. The server fetches the document
from its JSON endpoint; the offline page embeds it. Pure apart from reading its own assets, inside trajectory so
that both session_server and rollout stand on it without standing on each other.
"""

from trajectory.view.document import SegmentExtras, TurnExtras, build_document, piece_table, segment_of_sample
from trajectory.view.page import list_page, offline_page, session_page

__all__ = ["SegmentExtras", "TurnExtras", "build_document", "list_page", "offline_page", "piece_table",
           "segment_of_sample", "session_page"]
