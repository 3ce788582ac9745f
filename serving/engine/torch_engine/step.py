"""What the scheduler hands the model runner for one step: a slice of tokens per sequence.

A plain value, built on the event loop and read by the worker thread, so the two never share
mutable state while a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqSlice:
    """``token_ids`` of ``seq_id`` to compute this step, the first at position ``start``.

    ``block_table`` is the sequence's paged-KV table (empty for the contiguous layout);
    ``sample`` says whether the step ends the sequence's known tokens, so a token is sampled.
    """

    seq_id: str
    token_ids: list[int]
    start: int
    sample: bool
    block_table: list[int] = field(default_factory=list)
