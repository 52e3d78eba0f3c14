"""The OpenAI Responses front end: input items onto the chat turn, the response and its stream events."""
