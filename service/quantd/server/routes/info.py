"""``GET /v1/info``: what this server can do and its limits."""

from __future__ import annotations

from typing import get_args

from fastapi import APIRouter

import quantd
from quantd_client import Info, Limits
from quantd_client._schemas import (
    DType,
    GGUFMix,
    GranularityName,
    InputFormat,
    MethodArg,
    MethodInfo,
    MethodName,
    ObserverName,
)

from ..deps import StateDep, TenantDep
from ..problems import problem_responses
from ._docs import INFO_EXAMPLE, json_example


def method_infos() -> list[MethodInfo]:
    """Each method of the engine's registry with its arguments, in the order of ``MethodName``."""
    from quantd.engine.methods import METHODS

    return [MethodInfo(name=m.name, needs=m.needs, description=m.description,
                       args=[MethodArg(name=a.name, type=a.type, default=a.default, min=a.min, max=a.max,
                                       description=a.description) for a in m.args])
            for m in (METHODS[n] for n in get_args(MethodName))]


router = APIRouter(prefix="/v1", tags=["info"])


@router.get("/info", response_model=Info, summary="Version, devices, supported dtypes and limits",
            responses={200: json_example("What this server offers", INFO_EXAMPLE), **problem_responses(401)})
async def info(state: StateDep, _tenant: TenantDep) -> Info:
    from quantd.io.outputs import format_names  # the registry imports torch: not at app import

    s = state.settings
    return Info(
        version=quantd.__version__,
        devices=state.devices,
        dtypes=list(get_args(DType)),
        observers=list(get_args(ObserverName)),
        methods=list(get_args(MethodName)),
        method_args=method_infos(),
        granularities=list(get_args(GranularityName)),
        input_formats=list(get_args(InputFormat)),
        output_formats=format_names(),
        gguf_mixes=list(get_args(GGUFMix)),
        limits=Limits(max_upload_bytes=s.max_upload_bytes, max_sync_bytes=s.max_sync_bytes, max_queue=s.max_queue),
        auth=state.auth_enabled,
    )
