"""The session server: a Starlette app that proxies OpenAI chat to SGLang with token-in-token-out trajectories.

Public surface: `build_app(config, family)` and `ServerConfig`; run it with the `session-server` CLI.
"""

from session_server.app import build_app
from session_server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
