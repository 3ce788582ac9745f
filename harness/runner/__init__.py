"""Running profiles on stacks: the library under ``zl-bench run`` and ``zl-bench sweep``.

What a run is asked to do and the checks before it starts (``config``), its results directory
(``results``), the telemetry sampled while a stack is up (``sampling``), a stack stood up,
warmed and torn down (``stack``), a profile's schedule driven through a loader (``drive``, at
the loader's raised priority: ``priority``), how a run ends (``ending``) and its progress lines
(``console``). Rendering the report is bench's.
"""
