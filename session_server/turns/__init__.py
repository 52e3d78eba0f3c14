"""One turn, whatever API carried it: the engine call raced against everything that may end it, the prompt and
token limits, the commit, and the incremental reply deltas a streamed turn sends."""
