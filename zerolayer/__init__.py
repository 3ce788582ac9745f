"""zerolayer: the stack under test. Clients speak HTTP/2 straight to engine replicas.

Modules: ``contract`` (headers and error codes), ``engine`` (sim, null, torch, vllm),
``scheduler`` (admission as a pure function), ``server`` (the replica), ``client`` (the SDK).
"""

__version__ = "0.1.0"
