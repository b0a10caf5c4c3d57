"""Synchronous endpoints for uploads up to ``max_sync_bytes``: analyze, quantize, calibrate.

The body streams to a temp file, the engine runs in a bounded thread pool, and every temp file is
deleted whatever happens (the quantized artifact after it has been sent)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, TypeAdapter

from quantd.errors import InputTooLargeError
from quantd_client import AnalyzeResponse, CalibrateResponse, ObserverSpec, QuantConfig, Scheme
from quantd_client._schemas import AnalysisName

from ..deps import AppState, StateDep, TenantDep
from ..files import file_response
from ..uploads import MultipartForm, receive_multipart, remove_quietly
from ._docs import (
    ANALYZE_BODY,
    ANALYZE_EXAMPLE,
    ARTIFACT_200,
    CALIBRATE_BODY,
    CALIBRATE_EXAMPLE,
    QUANTIZE_BODY,
    SUMMARY_HEADER,
    SYNC_FILE_HEADERS,
    UPLOAD_ERRORS,
    json_example,
)
from ._forms import parse_json_field, run_engine

router = APIRouter(prefix="/v1", tags=["sync"])

MAX_ANALYZE_CONFIGS = 16
_CONFIG = TypeAdapter(QuantConfig)
_SCHEMES: TypeAdapter[list[Scheme]] = TypeAdapter(Annotated[list[Scheme], Field(min_length=1, max_length=MAX_ANALYZE_CONFIGS)])
_OBSERVER = TypeAdapter(ObserverSpec)
_ANALYSES: TypeAdapter[list[AnalysisName]] = TypeAdapter(Annotated[list[AnalysisName], Field(max_length=3)])
_SYNC_HINT = "; this is the synchronous limit (QUANTD_MAX_SYNC_BYTES): submit larger inputs to POST /v1/jobs"


@contextlib.contextmanager
def _sync_limit() -> Iterator[None]:
    """An input over the sync limit once loaded (an npz's inflated members: the engine is given
    ``max_sync_bytes`` as ``max_total_bytes``) says where larger inputs go, as an upload over it does."""
    try:
        yield
    except InputTooLargeError as e:
        e.detail += _SYNC_HINT
        e.args = (e.detail,)
        raise


def compact_json(obj: object) -> str:
    """JSON for a header: no spaces, ASCII only (header values are latin-1)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)


async def _receive(request: Request, state: AppState, text_field: str, *optional: str) -> MultipartForm:
    form = await receive_multipart(
        request, tmp_dir=state.settings.tmp_dir, max_file_bytes=state.settings.max_sync_bytes,
        file_fields={"file"}, text_fields={text_field, *optional}, required={"file", text_field}, hint=_SYNC_HINT,
        stopping=lambda: state.jobs.draining)
    state.metrics.inc("quantd_uploads_total", endpoint=request.url.path)
    return form


@router.post("/analyze", response_model=AnalyzeResponse, openapi_extra=ANALYZE_BODY,
             responses={200: json_example("Statistics per tensor and scheme", ANALYZE_EXAMPLE), **UPLOAD_ERRORS},
             summary="Error statistics of up to 16 schemes per tensor; no artifact")
async def analyze(request: Request, state: StateDep, _tenant: TenantDep) -> AnalyzeResponse:
    from quantd import io

    form = await _receive(request, state, "configs", "analyses")
    try:
        schemes = parse_json_field(form, "configs", _SCHEMES)
        analyses = parse_json_field(form, "analyses", _ANALYSES) if "analyses" in form.fields else []
        up = form.files["file"]
        with _sync_limit():
            return await run_engine(state, io.analyze_file, up.path, schemes, device=state.sync_device,
                                    filename=up.filename, analyses=analyses,
                                    max_total_bytes=state.settings.max_sync_bytes)
    finally:
        form.cleanup()


@router.post("/quantize", openapi_extra=QUANTIZE_BODY, response_class=Response,
             responses={200: {**ARTIFACT_200, "headers": {**SYNC_FILE_HEADERS, **SUMMARY_HEADER}}, **UPLOAD_ERRORS},
             summary="Quantize a file now; the response body is the artifact")
async def quantize(request: Request, state: StateDep, _tenant: TenantDep) -> Response:
    from quantd import io

    form = await _receive(request, state, "config")
    dst = state.settings.tmp_dir / f"{form.files['file'].path.name}.artifact"
    sent = False
    try:
        config = parse_json_field(form, "config", _CONFIG)
        from quantd.errors import ConfigError
        from quantd.io.outputs import artifact_suffix, get_format

        if get_format(config.output).writes_config:
            raise ConfigError(f"{config.output!r} writes a model directory (weights and config.json): submit it to "
                              "POST /v1/jobs", field="output")
        up = form.files["file"]
        with _sync_limit():
            report = await run_engine(state, io.quantize_file, up.path, dst, config, device=state.sync_device,
                                      filename=up.filename, max_total_bytes=state.settings.max_sync_bytes)
        state.metrics.inc("quantd_quantized_bytes_total", up.bytes)
        from quantd.io.files import sha256_file

        digest = await run_engine(state, sha256_file, dst)
        stem = up.filename.rsplit(".", 1)[0] or "model"
        resp = file_response(request, dst, etag_hex=digest, filename=f"{stem}{artifact_suffix(config.output)}",
                             headers={"Quantd-Summary": compact_json(report.summary.model_dump(mode="json"))},
                             on_done=lambda: remove_quietly(dst))
        sent = True
        return resp
    finally:
        form.cleanup()
        if not sent:
            with contextlib.suppress(OSError):
                remove_quietly(dst)


@router.post("/calibrate", response_model=CalibrateResponse, openapi_extra=CALIBRATE_BODY,
             responses={200: json_example("Ranges and qparams per layer", CALIBRATE_EXAMPLE), **UPLOAD_ERRORS},
             summary="Activation ranges and qparams for static activation quantization")
async def calibrate(request: Request, state: StateDep, _tenant: TenantDep) -> CalibrateResponse:
    from quantd import io

    form = await _receive(request, state, "observer")
    try:
        spec = parse_json_field(form, "observer", _OBSERVER)
        up = form.files["file"]
        with _sync_limit():
            return await run_engine(state, io.calibrate_file, up.path, spec, device=state.sync_device,
                                    filename=up.filename, max_total_bytes=state.settings.max_sync_bytes)
    finally:
        form.cleanup()
