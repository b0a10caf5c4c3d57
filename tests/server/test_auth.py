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
