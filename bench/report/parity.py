"""The report's engine-settings section: each stack's engine settings as its engines reported
them before any load (run.json's ``parity``, written by ``harness.parity``), a setting that
differs between stacks in red, with a red banner naming each difference. A run carries a
difference only where ``--allow-mismatch`` let it go on, or where the difference stopped it."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape

from harness.parity import SETTINGS
from harness.schema import Parity
from serving.engine.settings import EngineSettings


def _value(per_replica: Mapping[str, EngineSettings], setting: str) -> str:
    """A stack's value of ``setting``: one value, its replicas' values where they differ, or a
    dash where its engines have no such setting."""
    values = [getattr(s, setting) for s in per_replica.values()]
    shown = dict.fromkeys(str(v) for v in values if v is not None)
    return " / ".join(shown) or "-"


def _row(parity: Parity, setting: str, differs: bool) -> str:
    cells = [_value(per_replica, setting) for per_replica in parity.settings.values()]
    if set(cells) == {"-"}:
        return ""
    note = "DIFFERS" if differs else "same" if setting in parity.compared else "not compared"
    tds = "".join(f"<td>{escape(c)}</td>" for c in [*cells, note])
    css = " class='mismatch'" if differs else ""
    return f"<tr{css}><td class='l'>{escape(setting)}</td>{tds}</tr>"


def parity_section(parity: Parity) -> str:
    """The section's HTML; nothing where no stack's settings were read (an older run)."""
    differ = {m.setting for m in parity.mismatches}
    rows = "".join(_row(parity, s, s in differ) for s in SETTINGS)
    if not rows:
        return ""
    banner = ""
    if parity.mismatches:
        text = "; ".join(m.text() for m in parity.mismatches)
        banner = f"<div class='banner'>Engine settings differ between stacks: {escape(text)}</div>"
    unreadable = "".join(
        f"<li>{escape(stack)}: {escape(why)}</li>" for stack, why in parity.unreadable.items()
    )
    heads = "".join(f"<th>{escape(stack)}</th>" for stack in parity.settings)
    return (
        f"<h2>Engine settings</h2>{banner}<p>As each stack's engines reported them before any "
        f"load; parity: <b>{escape(parity.verdict)}</b>.</p>"
        + (f"<p>Not read:</p><ul>{unreadable}</ul>" if unreadable else "")
        + f"<table><tr><th class='l'>setting</th>{heads}<th></th></tr>{rows}</table>"
    )
