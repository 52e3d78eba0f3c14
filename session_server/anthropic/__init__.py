"""The Anthropic Messages front end: request blocks onto the chat turn, the reply and its stream events."""
