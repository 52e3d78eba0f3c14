"""The engine side: the client (a lean HTTP/1.1 pool for /generate, httpx for control calls), the /generate wire
format and its strict decode, placement over several workers, SGLang streaming sessions, and background drains of
aborted requests. Engine code knows session ids, never the session record."""
