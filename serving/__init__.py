"""The shared floor: what every stack under test uses and none of them owns.

The engines, the wire contract (headers, error codes, the OpenAI request table and answer
shapes, token rules, HTTP/2 and HPACK helpers), authentication and command-line types. The
zero-layer stack (``zerolayer``) and the orchestrator baselines (``baselines``) are siblings
above it; this package imports neither (import-linter keeps it so).
"""
