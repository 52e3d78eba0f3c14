"""Examples built on the session server and `rollout`; run from the repository root (not installed with the package)."""
