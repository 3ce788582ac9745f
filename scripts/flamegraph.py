"""A flame graph (SVG) and the top frames (text) from collapsed stacks, as ``py-spy record -f raw``
writes them (``frame;frame;... count`` per line; with ``--subprocesses`` each stack starts with
its process).

    python scripts/flamegraph.py STACKS.txt --svg OUT.svg [--title T] [--process SUBSTRING]
                                [--top 25] [--within FRAME]

``--process`` keeps the stacks of the processes whose description contains SUBSTRING (the
replica's, say, and not its engine's); ``--within`` keeps the stacks that pass through a frame
containing FRAME. The text lists the samples per process, then the frames with the most samples
of their own and the most samples in all, as shares of what was kept.
"""

from __future__ import annotations

import argparse
import html
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

WIDTH = 1600
ROW = 16
FONT = 11
MIN_WIDTH = 0.3  # pixels: narrower frames are not drawn


@dataclass
class Node:
    name: str
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)

    def child(self, name: str) -> Node:
        found = self.children.get(name)
        if found is None:
            found = self.children[name] = Node(name)
        return found


@dataclass
class Stacks:
    """Collapsed stacks read back: each as (process, frames, samples)."""

    rows: list[tuple[str, list[str], int]]

    @classmethod
    def read(cls, path: Path) -> Stacks:
        rows = []
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            processes = [f for f in frames if f.startswith("process ")]
            process = processes[-1].split(":", 1)[-1].strip('"') if processes else ""
            rows.append((process, [f for f in frames if not f.startswith("process ")], int(count)))
        return cls(rows)

    def keep(self, process: str | None, within: str | None) -> Stacks:
        return Stacks(
            [
                (p, frames, n)
                for p, frames, n in self.rows
                if (not process or process in p)
                and (not within or any(within in f for f in frames))
            ]
        )


def top_text(stacks: Stacks, everything: Stacks, top: int) -> str:
    per_process: Counter[str] = Counter()
    for process, _, n in everything.rows:
        per_process[process[:70] or "?"] += n
    own: Counter[str] = Counter()
    total_in: Counter[str] = Counter()
    total = 0
    for _, frames, n in stacks.rows:
        total += n
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            total_in[frame] += n
    lines = ["samples per process:"]
    lines += [f"  {n:8d}  {p}" for p, n in per_process.most_common()]
    lines.append(f"kept: {total} samples")
    if total:
        lines.append("frames with the most samples of their own:")
        lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
        lines.append("frames with the most samples in all:")
        lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in total_in.most_common(top)]
    return "\n".join(lines)


def tree(stacks: Stacks) -> Node:
    root = Node("all")
    for process, frames, n in stacks.rows:
        node = root
        node.count += n
        for name in [f"process {process[:60]}" if process else "", *frames]:
            if not name:
                continue
            node = node.child(name)
            node.count += n
    return root


def _color(name: str) -> str:
    h = zlib.crc32(name.encode())
    return f"rgb({205 + h % 50},{80 + (h >> 8) % 120},{40 + (h >> 16) % 40})"


def _rects(node: Node, x: float, depth: int, scale: float, out: list[str]) -> None:
    width = node.count * scale
    if width < MIN_WIDTH:
        return
    y = depth * ROW
    label = html.escape(node.name)
    text = label if width > 7 * len(node.name) else label[: max(0, int(width / 7) - 2)]
    out.append(
        f'<g><title>{label} ({node.count} samples)</title><rect x="{x:.2f}" y="{y}" '
        f'width="{width:.2f}" height="{ROW - 1}" fill="{_color(node.name)}"/>'
        f'<text x="{x + 2:.2f}" y="{y + ROW - 4}">{text}</text></g>'
    )
    child_x = x
    for child in sorted(node.children.values(), key=lambda c: c.name):
        _rects(child, child_x, depth + 1, scale, out)
        child_x += child.count * scale


def _depth(node: Node) -> int:
    return 1 + max((_depth(c) for c in node.children.values()), default=0)


def svg(stacks: Stacks, title: str) -> str:
    root = tree(stacks)
    scale = WIDTH / max(1, root.count)
    rects: list[str] = []
    _rects(root, 0.0, 1, scale, rects)
    height = (_depth(root) + 2) * ROW
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="monospace" font-size="{FONT}"><rect width="100%" height="100%" '
        f'fill="white"/><text x="4" y="{ROW - 4}">{html.escape(title)} ({root.count} '
        "samples; hover a frame for its name and count)</text>"
    )
    return head + "".join(rects) + "</svg>\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--svg", type=Path)
    parser.add_argument("--title", default="")
    parser.add_argument("--process")
    parser.add_argument("--within")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    everything = Stacks.read(args.stacks)
    kept = everything.keep(args.process, args.within)
    print(top_text(kept, everything, args.top))
    if args.svg is not None:
        args.svg.write_text(svg(kept, args.title or args.stacks.name))
        print(f"wrote {args.svg}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
