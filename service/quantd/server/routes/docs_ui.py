"""``/docs``: Swagger UI over ``/openapi.json``, its script, style sheet and icon served from the package
(``server/static/swagger-ui``) rather than a CDN, so the page works on hosts without internet access."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

SWAGGER_UI_VERSION = "5.35.0"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "static" / "swagger-ui"
ASSETS_PATH = "/docs/assets"

router = APIRouter(include_in_schema=False)


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json", title="quantd API",
        swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon-32x32.png",
        # No call to the public validator service either.
        swagger_ui_parameters={"validatorUrl": None},
    )


def install(app: FastAPI) -> None:
    """Serve ``/docs`` and its assets (the app is built with FastAPI's CDN-backed ``/docs`` and ``/redoc`` off)."""
    app.include_router(router)
    app.mount(ASSETS_PATH, StaticFiles(directory=ASSETS_DIR), name="swagger-ui-assets")
