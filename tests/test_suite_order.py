"""The suite's own scheduling (tests/conftest.py): the files it hands out first exist, so
a renamed file cannot silently drop back to the end of the queue."""

from __future__ import annotations

from pathlib import Path

from conftest import LONGEST_FIRST


def test_every_file_named_longest_first_exists():
    here = Path(__file__).resolve().parent
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [n for n in LONGEST_FIRST if not (here / n).is_file()] == []
