"""The soaks: thousands of chats against real processes, every received turn checked (soak: faults and load;
crash_soak: SIGKILLs of the server on its journal). Run one as `python -m soaks.NAME` from the repository root; the
tests/e2e soak tests run each in a small configuration."""
