"""Writes the small workload samples shipped in ``harness/data/``, the same bytes on every run.

Nothing is downloaded: the texts are English-looking sentences made from a small word list and
a few templates, and the lengths are drawn from long-tailed (log-normal) distributions shaped
roughly like the public files'. The samples are:

- ``sharegpt_sample.json``: ShareGPT format (a JSON list of ``{"id", "conversations"}``), 200
  conversations of 1 to 6 exchanges;
- ``mooncake_sample.jsonl``: Mooncake trace format, 300 requests over 60 s whose ``hash_ids``
  (512-token blocks) share a few system prompts;
- ``burstgpt_sample.csv``: BurstGPT trace format, 300 requests over about 60 s arriving in
  bursts, a few of them failed (0 response tokens).

Run ``python scripts/make_workload_samples.py`` (``--out DIR`` to write elsewhere); a test checks
that it reproduces the shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
from pathlib import Path
from typing import Final

DATA_DIR: Final = Path(__file__).resolve().parent.parent / "harness" / "data"
BYTES_PER_TOKEN: Final = 4  # the wire's rule, which the lengths below are sized by
SEED: Final = 20261201

_VOCABULARY: Final = (
    "the a an this that these some every each our your their data model system request server "
    "cache memory latency answer question table function value error result test user client "
    "file page line number list order time rate queue token prompt reply batch engine replica "
    "route load trace session history prefix block network call step plan change build run "
    "check read write send keep move use make find show give take explain compare describe "
    "improve fix measure count sort merge split join parse format quickly slowly carefully "
    "simply again always often never small large long short fast slow new old simple complex "
    "useful correct wrong better worse first last next same different clear open and or but "
    "because when while if then so with without for from into over under between after before "
    "about across"
)
WORDS: Final = tuple(_VOCABULARY.split())
TOPICS: Final = (
    "a Python function that sorts a list",
    "the difference between a process and a thread",
    "how a hash table handles collisions",
    "a SQL query that joins two tables",
    "why my web server is slow under load",
    "the history of the printing press",
    "a short story about a lighthouse keeper",
    "how to write a cover letter",
    "what a cache eviction policy is",
    "how vaccines train the immune system",
    "a recipe for a quick vegetable soup",
    "the rules of chess for a beginner",
)
OPENERS: Final = (
    "Can you explain {topic}?",
    "Please write {topic}.",
    "I need help with {topic}.",
    "What do you think about {topic}?",
    "Could you summarise {topic} in simple words?",
)
FOLLOW_UPS: Final = (
    "Thanks. Can you make it shorter?",
    "Why is that?",
    "Can you give an example?",
    "What about the edge cases?",
    "Please rewrite it in a more formal tone.",
)
REPLY_OPENERS: Final = (
    "Sure, here is an explanation.",
    "Good question.",
    "Here is one way to do it.",
    "Let us go through it step by step.",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def _text(rng: random.Random, head: str, tokens: int) -> str:
    """``head`` followed by sentences until the text is about ``tokens`` tokens long."""
    target = tokens * BYTES_PER_TOKEN
    parts = [head]
    size = len(head)
    while size < target:
        sentence = _sentence(rng)
        parts.append(sentence)
        size += len(sentence) + 1
    return " ".join(parts)[:target].rstrip()


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(0.0, sigma) * median))))


def _conversation(rng: random.Random, index: int) -> dict[str, object]:
    exchanges = rng.choices(range(1, 7), weights=(40, 20, 14, 10, 8, 8))[0]
    topic = rng.choice(TOPICS)
    messages = []
    for k in range(exchanges):
        opener = rng.choice(OPENERS).format(topic=topic) if k == 0 else rng.choice(FOLLOW_UPS)
        human = _text(rng, opener, _lognormal(rng, 24, 1.0, 4, 900))
        reply = _text(rng, rng.choice(REPLY_OPENERS), _lognormal(rng, 60, 0.8, 4, 1000))
        messages += [{"from": "human", "value": human}, {"from": "gpt", "value": reply}]
    return {"id": f"sample-{index:04d}", "conversations": messages}


def sharegpt(rng: random.Random, count: int = 200) -> str:
    """A JSON list, one conversation a line."""
    conversations = [json.dumps(_conversation(rng, i)) for i in range(count)]
    return "[\n" + ",\n".join(conversations) + "\n]\n"


def mooncake(rng: random.Random, count: int = 300, span_ms: int = 60_000) -> str:
    """Requests whose first blocks are one of a few shared system prompts (popular ones more
    often), the rest blocks of their own, as in Mooncake's traces."""
    prompt_blocks = [rng.randint(1, 6) for _ in range(8)]
    next_id = 0
    prompts = []
    for blocks in prompt_blocks:
        prompts.append(list(range(next_id, next_id + blocks)))
        next_id += blocks
    stamps = sorted(rng.randint(0, span_ms) for _ in range(count))
    lines = []
    for stamp in stamps:
        prefix = rng.choices(prompts, weights=[1 / (k + 1) for k in range(len(prompts))])[0]
        own = _lognormal(rng, 900, 0.9, 16, 6000)
        input_length = len(prefix) * 512 + own
        blocks = -(-input_length // 512)
        ids = prefix + list(range(next_id, next_id + blocks - len(prefix)))
        next_id += blocks - len(prefix)
        row = {
            "timestamp": stamp,
            "input_length": input_length,
            "output_length": _lognormal(rng, 150, 0.7, 1, 1024),
            "hash_ids": ids,
        }
        lines.append(json.dumps(row))
    return "\n".join(lines) + "\n"


def burstgpt(rng: random.Random, count: int = 300) -> str:
    """Bursty arrivals (gamma gaps of shape 0.3, mean 0.2 s), about 3 in 100 requests failed."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
    )
    at = 0.0
    for _ in range(count):
        at += rng.gammavariate(0.3, 0.2 / 0.3)
        request = _lognormal(rng, 600, 1.0, 1, 8000)
        response = 0 if rng.random() < 0.03 else _lognormal(rng, 250, 0.9, 1, 2000)
        model = rng.choice(("ChatGPT", "GPT-4"))
        writer.writerow(
            [f"{at:.3f}", model, request, response, request + response, "Conversation log"]
        )
    return out.getvalue()


def write_samples(out: Path) -> list[Path]:
    """Each sample from its own seeded generator, so changing one leaves the others alone."""
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "sharegpt_sample.json": sharegpt(random.Random(SEED)),
        "mooncake_sample.jsonl": mooncake(random.Random(SEED + 1)),
        "burstgpt_sample.csv": burstgpt(random.Random(SEED + 2)),
    }
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="where to write the samples")
    args = parser.parse_args()
    for path in write_samples(args.out):
        print(f"{path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
