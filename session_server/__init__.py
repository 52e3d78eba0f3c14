"""The session server: a Starlette app that proxies OpenAI chat to SGLang with token-in-token-out trajectories."""
