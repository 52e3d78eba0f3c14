"""The OpenAI Chat Completions front end: request fields and their SGLang mapping, the reply, logprobs, streaming."""
