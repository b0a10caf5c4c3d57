"""``/docs`` works offline: the Swagger UI page loads only assets that the server itself serves."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from .conftest import KEY_A


async def test_docs_page_references_only_local_assets_and_they_are_served(make_server):
    async with make_server(api_keys=f"a:{KEY_A}") as h:  # public, like /openapi.json, even with keys
        r = await h.client.get("/docs")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        html = r.text
        refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
        refs += re.findall(r"""\burl:\s*'([^']+)'""", html)
        assert len(refs) >= 4, html  # script, style sheet, icon, the OpenAPI document
        assert "http://" not in html and "https://" not in html and "//cdn" not in html
        kinds = {"/openapi.json": "application/json", ".js": "javascript", ".css": "text/css", ".png": "image/png"}
        for ref in refs:
            parts = urlsplit(ref)
            assert not parts.scheme and not parts.netloc and ref.startswith("/"), ref
            got = await h.client.get(ref)
            assert got.status_code == 200, ref
            want = next(v for k, v in kinds.items() if ref.endswith(k))
            assert want in got.headers["content-type"], (ref, got.headers["content-type"])
        js = (await h.client.get("/docs/assets/swagger-ui-bundle.js")).text
        assert "SwaggerUIBundle=" in js  # the global the page calls
        assert '"validatorUrl": null' in html  # no call to the public validator either


async def test_docs_assets_are_not_in_the_api_description_and_unknown_ones_are_404(server):
    paths = (await server.client.get("/openapi.json")).json()["paths"]
    assert not any(p.startswith("/docs") for p in paths)
    r = await server.client.get("/docs/assets/../settings.py")
    assert r.status_code == 404
    r = await server.client.get("/docs/assets/nothing.js")
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    assert (await server.client.get("/redoc")).status_code == 404  # its assets would come from a CDN
