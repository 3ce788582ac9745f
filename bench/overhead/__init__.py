"""``zl-bench overhead``: what the serving layer itself costs, over an in-process engine.

Each target (the in-process engine; the zero-layer stack SDK -> replica -> engine; the baseline
over HTTP/1.1; with ``--engine vllm`` also ``vllm-serve``, vLLM's own OpenAI server; any
plugged-in ``--target NAME=module:function``) is driven with the same schedule by the native
loader (``harness.loaders.native.run_schedule``): a fixed rate for a bounded time with at most
``in_flight`` requests outstanding (wrk2-style; or bursts of ``in_flight`` with ``--burst``, the
default with ``--engine vllm``), latency measured from each request's intended send time. Stacks
are stood up the one way (``harness.stacks.stand_up``, one replica) and measured one at a time,
each torn down before the next starts, so they never share the cores with each other.

Over the null engine every millisecond a request takes is the layer's own. Over the real vLLM
engine (``--engine vllm --engine-option model=DIR``) the in-process floor is vLLM's ``AsyncLLM``
called through the zero-layer adapter, and the baseline is Ray Serve LLM; unless ``--rate`` is
given, each level's rate is a quarter of the in-process engine's throughput measured closed-loop
at that level just before (so no stack's engine is overloaded on a small machine), or
conservative defaults where ``inproc`` is not run.

The tables give per target and in-flight level: TTFT and E2EL p50/p99, what each adds over
in-process, the tokens each request streamed (every target must serve exactly ``max_tokens``),
the loader's own CPU per request (``cli us/req``, idle spin excluded), and the server's CPU per
completed request and per streamed token: the CPU time of every process of the stack and their
descendants read before and after the level (psutil's 10 ms ticks: run long enough). ``layer``
is that less vLLM's engine core and workers (``VLLM::*`` processes), which busy-poll while
requests come often and cost the same in every stack; what is left is the serving layer's own
(for the stacks it includes ``AsyncLLM``'s front end, which for ``inproc`` is in ``cli us/req``).
For ``inproc`` the server is the engine's child processes (none for the null engine). A level
during which the host's cores were nearly all busy is marked saturated: trust its CPU figures
over its wall-clock ones. A one-line verdict compares the zero-layer replica with vLLM's own
server (added E2EL p50 and p99, layer CPU per token). With the null engine a replica's RSS is
then measured with 1000 concurrent open streams (sim engine, long generations) through one SDK
connection.

``--auth`` measures what authentication costs: each stack that checks API keys (the zero-layer
replica; the Ray Serve baseline over the null engine) runs a second time as ``NAME+auth``,
started with a key file and every request sent with its key, right after its run without; a
line per level gives the difference (E2EL p50 and p99, server CPU per request), beside
``Authenticator.authorize``'s own cost per call, timed in this process.

The package: ``model`` (settings, levels, roles), ``targets`` (the table of built-in targets and
the choice of those a run measures), ``measure`` (the drive and the CPU accounting), ``render``
(rows, tables, verdict, files) and ``cli`` (flags and the run), whose ``add_arguments`` and
``run_command`` are the subcommand's.
"""

from bench.overhead.cli import add_arguments, run_command

__all__ = ["add_arguments", "run_command"]
