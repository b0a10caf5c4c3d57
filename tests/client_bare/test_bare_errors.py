"""Error mapping (one factory from problem+json), Retry-After parsing, request ids."""

from __future__ import annotations

import email.utils
from pathlib import Path

import httpx
import pytest
from bare_helpers import Api, problem

from quantd_client import _exceptions as ex


@pytest.mark.parametrize(("status", "cls"), [
    (400, ex.BadRequest), (401, ex.AuthError), (403, ex.AuthError), (404, ex.NotFound),
    (409, ex.Conflict), (410, ex.Gone), (413, ex.PayloadTooLarge), (415, ex.UnsupportedMedia),
    (422, ex.ValidationError), (429, ex.RateLimited), (500, ex.ServerError), (502, ex.ServerError),
    (503, ex.ServerError), (418, ex.APIStatusError),
])
def test_every_status_maps_to_its_class(api: Api, status: int, cls: type[ex.APIStatusError]) -> None:
    c = api.client(lambda r: problem(status, f"detail {status}", errors=[{"loc": ["x"], "msg": "m"}]),
                   max_retries=0)
    with pytest.raises(cls) as info:
        api.call(c, "info")
    e = info.value
    assert type(e) is cls
    assert isinstance(e, ex.QuantdError)
    assert e.status == status
    assert e.detail == f"detail {status}"
    assert e.problem["status"] == status and e.problem["errors"] == [{"loc": ["x"], "msg": "m"}]
    assert e.request_id == f"rid-{status}"
    assert c.last_request_id == f"rid-{status}"
    assert f"detail {status}" in str(e) and f"rid-{status}" in str(e)


def test_validation_error_is_a_value_error_with_errors() -> None:
    resp = problem(422, "bad", errors=[{"loc": ["config", "scheme"], "msg": "no"}])
    e = ex.error_from_response(resp)
    assert isinstance(e, ValueError) and isinstance(e, ex.ValidationError)
    assert e.errors == [{"loc": ["config", "scheme"], "msg": "no"}]


def test_fastapi_default_422_shape_is_understood() -> None:
    resp = httpx.Response(422, json={"detail": [{"loc": ["body", "file"], "msg": "Field required"}]})
    e = ex.error_from_response(resp)
    assert isinstance(e, ex.ValidationError)
    assert e.detail == "Field required"
    assert e.problem["errors"][0]["loc"] == ["body", "file"]


def test_non_json_error_body_becomes_detail() -> None:
    e = ex.error_from_response(httpx.Response(502, text="<html>bad gateway</html>"))
    assert isinstance(e, ex.ServerError) and "bad gateway" in e.detail


def test_request_id_from_problem_body_when_no_header() -> None:
    resp = httpx.Response(404, json={"title": "t", "status": 404, "detail": "d", "request_id": "abc"})
    assert ex.error_from_response(resp).request_id == "abc"


def test_rate_limited_carries_retry_after() -> None:
    resp = httpx.Response(429, json={"title": "t", "status": 429, "detail": "slow"}, headers={"Retry-After": "7"})
    e = ex.error_from_response(resp)
    assert isinstance(e, ex.RateLimited) and e.retry_after == 7.0


def test_parse_retry_after_seconds_and_http_date() -> None:
    assert ex.parse_retry_after("3") == 3.0
    assert ex.parse_retry_after("1.5") == 1.5
    assert ex.parse_retry_after("-4") == 0.0
    assert ex.parse_retry_after(None) is None
    assert ex.parse_retry_after("soon") is None
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 12, usegmt=True)
    assert ex.parse_retry_after(date, now=now) == pytest.approx(12.0)
    past = email.utils.formatdate(now - 100, usegmt=True)
    assert ex.parse_retry_after(past, now=now) == 0.0


def test_transport_errors_map_to_connection_classes() -> None:
    assert type(ex.error_from_transport(httpx.ConnectError("refused"))) is ex.APIConnectionError
    assert type(ex.error_from_transport(httpx.ReadTimeout("slow"))) is ex.APITimeoutError


def test_a_gguf_artifact_says_what_it_is_instead_of_a_bad_header(tmp_path: Path) -> None:
    """``output: "gguf"`` gives llama.cpp's format: dequantize() and metadata say so and where to read it;
    stats stay empty rather than failing, the summary comes from the response."""
    from quantd_client._results import Artifact

    blob = b"GGUF" + (3).to_bytes(4, "little") + bytes(64)
    path = tmp_path / "m.gguf"
    path.write_bytes(blob)
    for art in (Artifact(data=blob), Artifact(path=path)):
        assert art.is_gguf and art.stats == {} and "format='gguf'" in repr(art)
        with pytest.raises(ex.QuantdError, match=r"GGUF artifact.*llama\.cpp.*gguf-py"):
            art.dequantize()
        with pytest.raises(ex.QuantdError, match="GGUF artifact"):
            _ = art.metadata
    assert "unreadable" in repr(Artifact(path=tmp_path / "missing.safetensors"))
    assert "unreadable" in repr(Artifact(data=b"junk"))
