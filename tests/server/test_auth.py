"""API keys: 401 problems with WWW-Authenticate, tenants isolated (404 for another's job)."""

from __future__ import annotations

import pytest

from .conftest import KEY_A, KEY_B, assert_problem


@pytest.fixture
async def keyed(make_server):
    async with make_server(api_keys=f"tenant-a:{KEY_A},tenant-b:{KEY_B}", workers=0) as h:
        yield h


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key-000"}, {"Authorization": KEY_A},
                                     {"Authorization": f"Basic {KEY_A}"}, {"Authorization": "Bearer "}])
async def test_v1_needs_a_valid_bearer_key(keyed, headers):
    for method, path in (("GET", "/v1/info"), ("GET", "/v1/jobs"), ("POST", "/v1/jobs"),
                         ("POST", "/v1/quantize")):
        r = await keyed.client.request(method, path, headers=headers)
        assert_problem(r, 401)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert KEY_A not in r.text


async def test_an_unknown_v1_path_or_method_needs_a_key_too(keyed):
    """Every /v1 call needs a key: without one, an unknown path or method is a 401, not a 404 or 405 that tells
    which endpoints exist; with one, the 404 and the 405 (with Allow)."""
    for method, path, status in (("GET", "/v1/unknown", 404), ("POST", "/v1/jobs/j_0123", 405),
                                 ("PUT", "/v1/info", 405), ("OPTIONS", "/v1/unknown", 404), ("GET", "/v1", 404)):
        r = await keyed.client.request(method, path)
        assert_problem(r, 401)
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = await keyed.client.request(method, path, headers={"Authorization": f"Bearer {KEY_A}"})
        assert_problem(r, status)
    assert (await keyed.client.options("/v1/jobs")).status_code == 204  # what the resource allows: no key
    assert_problem(await keyed.client.get("/nowhere"), 404)  # outside /v1


async def test_tenants_see_only_their_own_jobs(keyed):
    a = {"Authorization": f"Bearer {KEY_A}"}
    b = {"Authorization": f"Bearer {KEY_B}"}
    job = (await keyed.submit(headers=a)).json()
    assert (await keyed.client.get(f"/v1/jobs/{job['id']}", headers=a)).status_code == 200
    for path in ("", "/report", "/artifact", "/events"):
        assert_problem(await keyed.client.get(f"/v1/jobs/{job['id']}{path}", headers=b), 404)
    assert_problem(await keyed.client.delete(f"/v1/jobs/{job['id']}", headers=b), 404)
    assert (await keyed.client.get("/v1/jobs", headers=b)).json()["items"] == []
    assert [j["id"] for j in (await keyed.client.get("/v1/jobs", headers=a)).json()["items"]] == [job["id"]]
    assert (await keyed.client.get(f"/v1/jobs/{job['id']}", headers=a)).json()["status"] == "queued"
    info = (await keyed.client.get("/v1/info", headers=b)).json()
    assert info["auth"] is True


async def test_open_mode_uses_the_default_tenant(server):
    job = (await server.submit()).json()
    assert (await server.client.get(f"/v1/jobs/{job['id']}")).status_code == 200
