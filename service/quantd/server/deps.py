"""Typed application state and the dependencies routes take through ``Annotated`` aliases."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import anyio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from quantd_client import DeviceInfo

from .metrics import Metrics
from .problems import ProblemException
from .settings import Settings

if TYPE_CHECKING:
    from quantd.jobs import JobService

OPEN_TENANT = "default"


@dataclass
class AppState:
    """Everything the routes need, built by the lifespan of ``create_app``."""

    settings: Settings
    metrics: Metrics
    jobs: JobService
    sync_device: str
    devices: list[DeviceInfo]
    # sha256(key) → tenant: compared in constant time against every entry, the raw keys are not kept.
    key_digests: list[tuple[bytes, str]] = field(default_factory=list)
    sync_limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(2))
    # Job submissions' checks (headers, plans, calibration values) run apart from synchronous quantizations:
    # a long /v1/quantize never holds a submission.
    check_limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(2))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.key_digests)


def get_state(request: Request) -> AppState:
    state: AppState | None = getattr(request.app.state, "quantd", None)
    if state is None:  # only reachable when the app is served without its lifespan
        raise ProblemException(503, "the server is starting or stopping")
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def _unauthorized(detail: str) -> ProblemException:
    return ProblemException(401, detail, headers={"WWW-Authenticate": 'Bearer realm="quantd"'})


def tenant_for_key(state: AppState, key: str) -> str | None:
    """The tenant owning ``key``. Every configured key is compared (no early exit), in constant time."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
    found: str | None = None
    for known, tenant in state.key_digests:
        if hmac.compare_digest(digest, known):
            found = tenant
    return found


# Declares the Bearer scheme in the OpenAPI schema (``securitySchemes``, and ``security`` on every /v1
# operation); the header itself is checked below, with problem+json answers.
BEARER = HTTPBearer(auto_error=False, scheme_name="apiKey",
                    description="An API key from QUANTD_API_KEYS / QUANTD_API_KEYS_FILE, as "
                                "`Authorization: Bearer <key>`; not needed when the server runs without keys.")


def authenticate(request: Request, state: AppState) -> str:
    """The caller's tenant: from ``Authorization: Bearer <key>``, or ``default`` in open mode; a 401 problem
    when keys are configured and the request has none of them."""
    if not state.auth_enabled:
        return OPEN_TENANT
    header = request.headers.get("authorization")
    if header is None:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("the Authorization header must be 'Bearer <key>'")
    found = tenant_for_key(state, key.strip())
    if found is None:
        raise _unauthorized("invalid API key")
    return found


def get_tenant(request: Request, state: StateDep,
               _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)] = None) -> str:
    """The caller's tenant (:func:`authenticate`), kept on the request for the access log and metrics."""
    tenant = authenticate(request, state)
    request.state.tenant = tenant
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]
