"""Where a command writes, checked before it measures anything: an ``--out`` that is a file
where a directory is wanted (or the reverse), or that lies under a file or an unwritable
directory, is the user's mistake, one line, before a minute of measurement is lost to it."""

from __future__ import annotations

import os
from pathlib import Path

from harness.errors import UsageError


def _writable_from(path: Path, option: str, asked: Path) -> None:
    """What does not exist yet of ``path`` can be made: its nearest existing ancestor (or
    itself) is a directory this process may write into."""
    found = next((p for p in (path, *path.parents) if p.exists()), Path.cwd())
    if not found.is_dir():
        raise UsageError(f"{option} {asked}: {found} is a file, not a directory")
    if not os.access(found, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {asked}: {found} is not writable")


def output_dir(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a directory a command may create and write into; UsageError otherwise."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file; give a directory")
    _writable_from(path, option, path)
    return path


def output_file(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a file a command may create or replace, its missing directories made here so
    that the command's one write at the end cannot fail on them; UsageError otherwise."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path} is not writable")
    _writable_from(path.parent, option, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
