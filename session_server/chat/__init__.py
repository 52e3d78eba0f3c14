"""The OpenAI Chat Completions front end, cut like every API folder: routes, protocol (the request), reply (the
chat completion), stream (its chunks) and serving (the FrontEnd); beside them what only Chat has: the body read by
what is new in it (chat_body.py) and logprobs in OpenAI's shape (logprobs.py)."""
