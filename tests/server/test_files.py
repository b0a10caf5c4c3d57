"""Range header parsing (RFC 9110 §14): one range served, others ignored, past-the-end unsatisfiable."""

from __future__ import annotations

import pytest

from quantd.server.files import parse_range


@pytest.mark.parametrize("header, size, expected", [
    ("bytes=0-9", 100, (0, 9)),
    ("bytes=90-200", 100, (90, 99)),       # end clamped to the file
    ("bytes=95-", 100, (95, 99)),
    ("bytes=-10", 100, (90, 99)),
    ("bytes=-500", 100, (0, 99)),          # suffix longer than the file: the whole file
    ("bytes=100-", 100, "unsatisfiable"),
    ("bytes=-0", 100, "unsatisfiable"),
    ("bytes=0-0", 0, "unsatisfiable"),
    ("bytes=5-2", 100, None),              # invalid: ignored
    ("bytes=0-1,5-6", 100, None),          # several ranges: answered with the whole file
    ("items=0-1", 100, None),
    ("bytes=-", 100, None),
    ("bytes=a-b", 100, None),
])
def test_parse_range(header, size, expected):
    assert parse_range(header, size) == expected
