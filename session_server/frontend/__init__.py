"""What the three front ends (chat/, responses/, messages/) share, built once below them.

Each API folder holds the same five parts -- routes (handlers), protocol (its request -> the turn request), reply
(the plain body), stream (the streaming format) and serving (the turn pipeline's `FrontEnd`) -- and every one maps
its request onto the chat-shaped turn request here (chat_request.py, with the field checks of fields.py and the tool
grammars of tool_grammar.py), reads a reply's facts from one place (reply_facts.py: how the turn ended, the token
counts, SSE framing), renders its errors from one place (errors.py: every API's error shapes, streamed ones too),
reads the lists its requests are made of with the same 400s (request_items.py), puts token ids on replies the same
way (token_ids.py), and finds a root-URL request's session the same way (root_session.py).
"""
