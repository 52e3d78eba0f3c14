"""Sessions: the record and its in-flight claim, the registry with tombstones, the lifecycle that owns every way a
chat or a session ends, the SQLite journal and the restart from it, and the idle sweep."""
