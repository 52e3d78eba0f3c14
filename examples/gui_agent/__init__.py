"""A GUI agent on a toy desktop: screenshots through the session server, click/type tool calls back, samples with
image spans out (docs/gui-agent.md; `make demo-gui`)."""
