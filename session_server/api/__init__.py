"""The session server's own routes: sessions (create, inspect, delete, model list), samples, admin (health, ready,
metrics, pause/continue), and the root routes that name their session by header instead of by path."""
