"""The wire-level bottom of the stack: the header contract, OpenAI request and response shapes,
the prompt-token rule, and the HTTP/2 and HPACK speed-ups shared by server and client.

Everything above (server, client, engine, baselines, harness) may import it; it imports nothing
of the project's own but itself.
"""
