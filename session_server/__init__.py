"""The session server: a Starlette app that proxies OpenAI chat to SGLang with token-in-token-out trajectories.

Public surface: `build_app(config, family)` and `ServerConfig`; run it with the `session-server` CLI.
"""

from .app import build_app
from .config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
