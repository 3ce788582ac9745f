"""Where the repository's files are, for tests at any depth under ``tests/``."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TEST_DATA = ROOT / "tests" / "data"
