"""Range header parsing (RFC 9110 §14): one range served, others ignored, past-the-end unsatisfiable."""

from __future__ import annotations

import pytest

from quantd.server.files import parse_range

from .conftest import assert_problem


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
    # positions of any length (past int()'s 4300-digit limit): compared, never converted
    pytest.param("bytes=0-" + "9" * 5000, 100, (0, 99), id="huge-last"),  # past the end stands for the end
    pytest.param("bytes=" + "9" * 5000 + "-", 100, "unsatisfiable", id="huge-first"),
    pytest.param("bytes=" + "9" * 5000 + "-" + "9" * 5000, 100, "unsatisfiable", id="huge-both"),
    pytest.param("bytes=" + "9" * 5000 + "-5", 100, None, id="huge-first-small-last"),
    pytest.param("bytes=-" + "9" * 5000, 100, (0, 99), id="huge-suffix"),
    pytest.param("bytes=" + "0" * 5000 + "5-" + "0" * 5000 + "9", 100, (5, 9), id="leading-zeros"),
    pytest.param("bytes=\u0664-\u0665", 100, None, id="non-ascii-digits"),
])
def test_parse_range(header, size, expected):
    assert parse_range(header, size) == expected


async def test_an_absurd_range_on_an_artifact_is_answered_not_a_500(server):
    r = await server.submit()
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"])
    assert job["status"] == "succeeded", job
    url = f"/v1/jobs/{job['id']}/artifact"
    art = (await server.client.get(url)).content
    r = await server.client.get(url, headers={"Range": "bytes=0-" + "9" * 5000})
    assert r.status_code == 206 and r.content == art
    assert r.headers["content-range"] == f"bytes 0-{len(art) - 1}/{len(art)}"
    r = await server.client.get(url, headers={"Range": "bytes=" + "9" * 5000 + "-"})
    assert_problem(r, 416)
    assert r.headers["content-range"] == f"bytes */{len(art)}"
