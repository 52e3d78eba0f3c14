"""The OpenAI Responses front end, cut like every API folder: routes, protocol (input items onto the chat turn,
`previous_response_id`), reply (the response object, the builder its stream shares, a stored turn's response),
stream (its events) and serving (the FrontEnd)."""
