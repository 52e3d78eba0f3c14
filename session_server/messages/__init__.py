"""The Anthropic Messages front end, cut like every API folder: routes, protocol (content blocks onto the chat turn,
count_tokens), reply (the message and the builder its stream shares), stream (its events) and serving (the
FrontEnd)."""
