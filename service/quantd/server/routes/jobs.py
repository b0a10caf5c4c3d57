"""Asynchronous jobs: submit (streamed upload, checked against the config first), list, get,
follow (SSE), report, artifact (Range/ETag), cancel."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import anyio
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import iterate_in_threadpool

from quantd.errors import naming
from quantd.jobs.errors import IdempotencyConflict, InvalidListQuery, SourceForbidden
from quantd_client import Job, JobList, QuantConfig, Report
from quantd_client._schemas import FileList, JobByReference, JobStatus

from ..deps import AppState, StateDep, TenantDep
from ..files import file_response, ranged_response
from ..problems import ProblemException, problem_responses, validation_errors
from ..sse import sse_stream
from ..uploads import FileSink, UploadedFile, receive_multipart
from ._docs import (
    ARTIFACT_200,
    ARTIFACT_206,
    ARTIFACT_307,
    ARTIFACT_HEAD_200,
    ARTIFACT_HEAD_206,
    ARTIFACT_PARAMETERS,
    CANCELLED_EXAMPLE,
    JOB_BODY,
    JOB_EXAMPLE,
    REPORT_EXAMPLE,
    UPLOAD_ERRORS,
    json_example,
)
from ._forms import parse_json_field, run_check

if TYPE_CHECKING:
    from quantd.jobs.prepared import PreparedRun

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
log = logging.getLogger("quantd.server")

_CONFIG = TypeAdapter(QuantConfig)
_JOB_ERRORS = problem_responses(401, 404, 410)
_IDEM_MAX = 200


def check_finite(up: UploadedFile, plans: Sequence[Any], reader: Any = None) -> None:
    """A NaN or Inf in any float tensor of the upload (quantized or kept as it is) is a 422 naming it, before
    the job is accepted (CONTRACT §2: NaN/Inf weights are a 4xx). A safetensors upload was scanned while it
    streamed (``up.non_finite``); a PyTorch or NumPy file is read once more, tensor by tensor (through
    ``reader``, the upload's open reader, if given). A GGUF input is checked by the worker (the job fails with
    the reason)."""
    from quantd import io
    from quantd.errors import NonFiniteError
    from quantd.io.formats import QUANTIZABLE, torch_dtype

    floats = [p.info.name for p in plans if torch_dtype(p.info.dtype) in QUANTIZABLE and math.prod(p.info.shape)]
    bad = up.non_finite
    if floats and bad is None and io.detect_format(up.path) in ("pytorch", "npy", "npz"):
        if reader is None:
            with io.open_model(up.path, filename=up.filename) as opened:
                bad = opened.non_finite(floats)
        else:
            bad = reader.non_finite(floats)
    checked = set(floats)
    first = next((n for n in (bad or ()) if n in checked), None)
    if first is not None:
        raise NonFiniteError(f"tensor {first!r} has NaN or Inf values", tensor=first)


def _check_upload(up: UploadedFile, config: QuantConfig | None, calibration: UploadedFile | None = None, *,
                  max_total_bytes: int | None = None, imatrix: UploadedFile | None = None) -> Any:
    """Format by magic bytes, tensor list, and (for the model) the config planned against it and the
    calibration file's index (a GGUF job's importance matrix against its tensors): 415/422 before the job is
    accepted; tensors that would load to more than ``max_total_bytes`` in all (a compressed .npz) are 413.
    Returns the jobs layer's StoredUpload."""
    from quantd import io
    from quantd.io.calibration import MethodCalibration
    from quantd.jobs.storage import StoredUpload

    fmt = io.detect_format(up.path)
    if config is not None:  # output "gguf" needs a GGUF input, as the synchronous quantization checks
        from quantd.io.outputs.gguf import check_format

        check_format(fmt, config)
    with io.open_model(up.path, filename=up.filename, max_total_bytes=max_total_bytes) as reader:
        tensors = list(reader.tensors)
        if config is not None:
            from quantd.errors import ConfigError
            from quantd.io.outputs import get_format

            if get_format(config.output).writes_config and fmt not in ("safetensors", "pytorch"):
                raise ConfigError(f"{config.output} writes a model directory: its input is a safetensors file or "
                                  f"a PyTorch state dict, not {fmt}", field="output")
            index = None
            if calibration is not None:
                with naming("the calibration file"):
                    index = MethodCalibration.describe(calibration.path)
            plans = io.plan(tensors, config, index)
            check_finite(up, plans, reader)
            if imatrix is not None and config.output == "gguf":
                from quantd.io.imatrix import load_imatrix
                from quantd.io.outputs.gguf import check_importance

                with naming("the calibration file"):
                    check_importance(plans, load_imatrix(imatrix.path))
    return StoredUpload(path=up.path, filename=up.filename, bytes=up.bytes, sha256=up.sha256, format=fmt,
                        tensors=len(tensors))


def _check_text_calibration(up: UploadedFile, config: QuantConfig | None) -> Any:
    """A JSONL calibration part (CONTRACT §10): its lines parsed here; the model it runs on is checked with
    the directory (:func:`_check_directory`)."""
    from quantd.io.text_calibration import read_jsonl
    from quantd.jobs.storage import StoredUpload

    lines = read_jsonl(up.path)
    return StoredUpload(path=up.path, filename=up.filename, bytes=up.bytes, sha256=up.sha256, format="jsonl",
                        tensors=len(lines))


def _check_calibration(up: UploadedFile, config: QuantConfig, max_total_bytes: int | None = None) -> Any:
    """The calibration part by its content: an importance matrix for GGUF output, JSONL lines, or the
    methods' safetensors file."""
    from quantd.io.text_calibration import is_jsonl

    if config.output == "gguf":
        return _check_imatrix(up, config)
    if is_jsonl(up.path):
        return _check_text_calibration(up, config)
    return _check_upload(up, None, max_total_bytes=max_total_bytes)


def _check_directory(parts: list[UploadedFile], config: QuantConfig, dst: Any,
                     calibration: UploadedFile | None = None) -> Any:
    """A model directory upload (CONTRACT §8): every path checked (422 naming it), the shards against the
    index and the config against every tensor, then the files packed into one tar at ``dst`` (the job's
    stored input). Its sha256 is that of the sorted ``path sha256`` lines of its files."""

    from quantd import io
    from quantd.io.model_dir import (
        ModelFiles,
        PathError,
        check_no_folder_clash,
        check_relpath,
        directory_digest,
        pack_tar,
        plan_directory,
    )
    from quantd.jobs.storage import StoredUpload

    by_path: dict[str, UploadedFile] = {}
    for up in parts:
        rel = check_relpath(up.raw_filename or "")
        if rel in by_path:
            raise PathError(f"path {rel!r}: given twice", field="file")
        by_path[rel] = up
    check_no_folder_clash(by_path)
    model = ModelFiles({rel: up.path for rel, up in by_path.items()})
    index = None
    from quantd.io.text_calibration import is_jsonl

    if calibration is not None and is_jsonl(calibration.path):  # the worker runs the model on its lines
        from quantd.io.model_calibration import plan_text_calibration

        plans = plan_text_calibration(model, config, calibration.path).plans
    else:
        if calibration is not None:
            from quantd.io.calibration import MethodCalibration

            with naming("the calibration file"):
                index = MethodCalibration.describe(calibration.path)
        plans, _ = plan_directory(model, config, index)
    for rel, shard_plans in plans.items():
        check_finite(by_path[rel], shard_plans)
    manifest = pack_tar(sorted((rel, up.path) for rel, up in by_path.items()), dst)
    digest = directory_digest({f["path"]: f["sha256"] for f in manifest})
    return StoredUpload(path=dst, filename="model", bytes=sum(f["bytes"] for f in manifest), sha256=digest,
                        format=io.detect_format(model.files[model.weights[0]]),
                        tensors=sum(len(p) for p in plans.values()), files=tuple(manifest))


def _is_directory(parts: list[UploadedFile]) -> bool:
    """Several ``file`` parts: a model directory. One part is a one-file job whatever its filename (v1: the
    filename is for display only)."""
    return len(parts) > 1


def _check_imatrix(up: UploadedFile, config: QuantConfig | None) -> Any:
    """A GGUF job's calibration: a llama.cpp importance matrix (legacy ``.dat`` or GGUF), parsed in full."""
    from quantd.io.imatrix import load_imatrix
    from quantd.jobs.storage import StoredUpload

    table = load_imatrix(up.path)
    return StoredUpload(path=up.path, filename=up.filename, bytes=up.bytes, sha256=up.sha256, format="imatrix",
                        tensors=len(table))


async def _accept(request: Request, state: AppState, tenant: str, idempotency_key: str | None) -> Job:
    runs: list[PreparedRun] = []  # at most one: quantizing the model while it streams in
    job_id = state.jobs.new_job_id()
    # files an object store receives while they stream in, under job_id's keys, with their part's field
    streamed: list[tuple[Path, str]] = []

    def on_file_start(up: UploadedFile, fields: dict[str, str]) -> FileSink | None:
        run = start_run(up, fields)
        if run is not None:
            return run
        try:
            sink = state.jobs.stream_upload(up.path, job_id, "input" if up.field == "file" else "calibration")
        except Exception:  # the upload goes on; the file is sent whole when the job is submitted
            log.exception("could not start storing the upload while it streams")
            return None
        if sink is not None:
            streamed.append((up.path, up.field))
        return sink

    def start_run(up: UploadedFile, fields: dict[str, str]) -> PreparedRun | None:
        if up.field != "file" or "config" not in fields:  # a config after the file: nothing to start with
            return None
        try:
            config = _CONFIG.validate_json(fields["config"])
        except ValidationError:  # answered with a 422 once the body is in
            return None
        try:
            run = state.jobs.prepare(up.path, config, size_bound=state.settings.max_upload_bytes)
        except Exception:  # a shortcut only: the upload goes on without it
            log.exception("could not start quantizing during the upload")
            return None
        if run is not None:
            runs.append(run)
        return run

    try:
        form = await receive_multipart(
            request, tmp_dir=state.jobs.upload_dir, max_file_bytes=state.settings.max_upload_bytes,
            file_fields={"file", "calibration"}, text_fields={"config"}, required={"file", "config"},
            on_file_start=on_file_start, repeatable=frozenset({"file"}), stopping=lambda: state.jobs.draining)
        try:
            config = parse_json_field(form, "config", _CONFIG)
            calib = form.files.get("calibration")
            calibration = None
            if calib is not None:  # first: the model's plan checks the methods' calibration against it
                with naming("the calibration file"):  # not the model's: both are checked the same way
                    calibration = await run_check(state, _check_calibration, calib, config,
                                                state.settings.max_upload_bytes)
            imatrix = None
            if config.output == "gguf":  # an importance matrix, not the methods' calibration
                calib, imatrix = None, calib
            parts = form.file_lists.get("file", [])
            tar = None
            if _is_directory(parts):
                for started in runs:  # quantizing during the upload is for one file
                    state.jobs.discard_prepared(started)
                runs.clear()
                tar = state.jobs.new_upload_path(".tar")
                try:
                    upload = await run_check(state, _check_directory, parts, config, tar, calib)
                except BaseException:
                    tar.unlink(missing_ok=True)
                    raise
                for path, field in streamed:  # a first part an object store received as the input: the tar is
                    if field == "file":  # (the calibration part stays the job's calibration)
                        await anyio.to_thread.run_sync(state.jobs.discard_upload, path)
                streamed[:] = [(path, field) for path, field in streamed if field != "file"]
            else:
                if calibration is not None and calibration.format == "jsonl":
                    from quantd.errors import ConfigError

                    raise ConfigError("a JSONL calibration part runs the model: send a model directory (config.json "
                                      "and its weights as several file parts), or a safetensors calibration file "
                                      "with one weights file", field="calibration")
                upload = await run_check(state, _check_upload, form.files["file"], config, calib,
                                          max_total_bytes=state.settings.max_upload_bytes, imatrix=imatrix)
            state.metrics.inc("quantd_uploads_total", endpoint="jobs")
            run = runs.pop() if runs else None  # the jobs layer owns it from here
            try:
                return await state.jobs.submit(tenant=tenant, upload=upload, config=config,
                                               calibration=calibration, idempotency_key=idempotency_key,
                                               prepared=run, job_id=job_id)
            finally:
                if tar is not None:  # moved under uploads/ by an accepted job; otherwise it goes
                    tar.unlink(missing_ok=True)
        finally:
            form.cleanup()  # files the jobs layer adopted have moved; the rest go
    finally:
        for run in runs:  # the upload or its checks failed: the run stops and its artifact goes
            state.jobs.discard_prepared(run)
        for path, _ in streamed:  # what the object store received of uploads no job took (a no-op for the rest)
            await anyio.to_thread.run_sync(state.jobs.discard_upload, path)


_BY_REFERENCE = TypeAdapter(JobByReference)
_MAX_JSON_BYTES = 256 * 1024


async def _accept_reference(request: Request, state: AppState, tenant: str, idempotency_key: str | None) -> Job:
    """A JSON body naming its data (CONTRACT §11): 403 outside the tenant's prefixes, before any fetch."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_JSON_BYTES:
            raise ProblemException(413, f"a JSON job body is at most {_MAX_JSON_BYTES} bytes",
                                   title="Payload too large", type_="urn:quantd:too-large")
    try:
        spec = _BY_REFERENCE.validate_json(bytes(body))
    except ValidationError as e:
        errs = validation_errors(e.errors(include_url=False), prefix=("body",))
        first = errs[0] if errs else {"loc": ["body"], "msg": "invalid"}
        raise ProblemException(422, f"{'.'.join(str(p) for p in first['loc'][1:])}: {first['msg']}",
                               title="Validation failed", type_="urn:quantd:validation-error", errors=errs) from None
    return await state.jobs.submit_reference(tenant=tenant, source=spec.source, destination=spec.destination,
                                             config=spec.config, max_bytes=state.settings.max_upload_bytes,
                                             idempotency_key=idempotency_key)


@router.post("", status_code=202, response_model=Job, openapi_extra=JOB_BODY,
             summary="Submit a quantization job (streamed upload); 202 with Location",
             responses={202: {**json_example("Accepted: the job is persisted and queued", JOB_EXAMPLE),
                              "headers": {"Location": {"schema": {"type": "string"},
                                                       "description": "/v1/jobs/{id}"}}},
                        **UPLOAD_ERRORS, **problem_responses(403, 409, 429, examples={
                            IdempotencyConflict: "Idempotency-Key 'k1' was used for another input or config",
                            SourceForbidden: "source 's3://other/x.safetensors': it is not under an allowed prefix "
                                             "(QUANTD_SOURCE_PREFIXES)"})})
async def submit_job(
    request: Request, state: StateDep, tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(max_length=_IDEM_MAX,
                                                  description="same key + same input → the same job")] = None,
) -> JSONResponse:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        job = await _accept_reference(request, state, tenant, idempotency_key)
    else:
        job = await _accept(request, state, tenant, idempotency_key)
    return JSONResponse(job.model_dump(mode="json"), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})


@router.get("", response_model=JobList, summary="The caller's jobs, newest first",
            responses={200: json_example("A page of jobs", {"items": [JOB_EXAMPLE], "next_cursor": "WzE3MDAw..."}),
                       **problem_responses(401, 422, examples={
                           InvalidListQuery: "cursor is not one this server issued"})})
async def list_jobs(
    state: StateDep, tenant: TenantDep,
    status: Annotated[JobStatus | None, Query(description="only jobs with this status")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=512, description="next_cursor of the previous page")] = None,
) -> JobList:
    return await state.jobs.list(tenant, status=status, limit=limit, cursor=cursor)


@router.get("/{job_id}", response_model=Job, summary="One job",
            responses={200: json_example("The job", JOB_EXAMPLE), **_JOB_ERRORS})
async def get_job(job_id: str, state: StateDep, tenant: TenantDep) -> Job:
    return await state.jobs.get(tenant, job_id)


# One event of the stream, as OpenAPI 3.1 describes a text/event-stream (its ``schema`` is per event).
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": ["progress", "succeeded", "failed", "cancelled"]},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "description": "progress: the job's Progress; succeeded, failed, cancelled: the Job"},
    },
}


@router.get("/{job_id}/events", summary="Follow a job: progress events, then one terminal event",
            response_class=StreamingResponse,
            responses={200: {"description": "Server-sent events", "content": {"text/event-stream": {
                "schema": SSE_EVENT_SCHEMA,
                "example": ('event: progress\ndata: {"tensors_done":3,"tensors_total":10,"bytes_done":0,'
                            '"bytes_total":0,"fraction":0.3}\n\nevent: succeeded\ndata: {"id":"..."}\n\n')}}},
                       **_JOB_ERRORS})
async def job_events(job_id: str, state: StateDep, tenant: TenantDep) -> StreamingResponse:
    await state.jobs.get(tenant, job_id)  # 404 as a problem, before the stream starts
    stream = sse_stream(state.jobs.events(tenant, job_id), keepalive_s=state.settings.sse_keepalive_s)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/{job_id}/report", response_model=Report, summary="Per-tensor statistics (409 until succeeded)",
            responses={200: json_example("Per-tensor statistics; a skipped tensor has \"skipped\": true, a \"reason\" "
                                         "and null scheme and stats", REPORT_EXAMPLE), **_JOB_ERRORS,
                       **problem_responses(409)})
async def job_report(job_id: str, state: StateDep, tenant: TenantDep) -> Report:
    return await state.jobs.report(tenant, job_id)


_ARTIFACT_304 = {"description": "Not modified (If-None-Match matched the ETag)",
                 "headers": {"ETag": {"schema": {"type": "string"}}}}
_ARTIFACT_ERRORS = {**_JOB_ERRORS, **problem_responses(409, 412, 416)}
_ARTIFACT_HEADERS = {"parameters": ARTIFACT_PARAMETERS}


def _artifact_filename(job_id: str, output: str) -> str:
    """The download's name: the job id and the format's artifact suffix (``.quantd.safetensors``, ``.gguf``)."""
    from quantd.io.outputs import artifact_suffix

    return f"{job_id}{artifact_suffix(output)}"


@router.head("/{job_id}/artifact", summary="The artifact's headers (size, ETag, ranges), no body",
             response_class=Response, openapi_extra=_ARTIFACT_HEADERS,
             responses={200: ARTIFACT_HEAD_200, 206: ARTIFACT_HEAD_206, 304: _ARTIFACT_304, 307: ARTIFACT_307,
                        **_ARTIFACT_ERRORS})
async def job_artifact_head(job_id: str, request: Request, state: StateDep, tenant: TenantDep) -> Response:
    return await job_artifact(job_id, request, state, tenant)


@router.get("/{job_id}/artifact", summary="The artifact, streamed; ETag = sha256; Range honoured",
            response_class=Response, openapi_extra=_ARTIFACT_HEADERS,
            responses={200: ARTIFACT_200, 206: ARTIFACT_206, 304: _ARTIFACT_304, 307: ARTIFACT_307,
                       **_ARTIFACT_ERRORS})
async def job_artifact(job_id: str, request: Request, state: StateDep, tenant: TenantDep) -> Response:
    job = await state.jobs.get(tenant, job_id)
    is_tar = job.result is not None and job.result.files is not None  # a directory output: one tar
    filename = f"{job_id}.tar" if is_tar else _artifact_filename(job_id, job.config.output)
    media_type = "application/x-tar" if is_tar else "application/octet-stream"
    art = await state.jobs.artifact(tenant, job_id, filename=filename)
    if art.url is not None:  # QUANTD_STORAGE_PRESIGN: the client fetches it from the object store itself
        return RedirectResponse(art.url, status_code=307, headers={"ETag": f'"{art.sha256}"'})
    try:
        if art.path is not None:
            return file_response(request, art.path, etag_hex=art.sha256, filename=filename, media_type=media_type)
        return ranged_response(request, art.size, lambda start, length: iterate_in_threadpool(art.read(start, length)),
                               etag_hex=art.sha256, filename=filename, media_type=media_type)
    except FileNotFoundError:  # deleted (TTL sweep, DELETE) since the job layer looked
        raise ProblemException(410, f"the artifact of job {job_id!r} is gone", title="Job files expired",
                               type_="urn:quantd:job-expired") from None


@router.delete("/{job_id}", response_model=Job, summary="Cancel a queued or running job and delete its files",
               responses={200: json_example("The job, cancelled (or still running until its worker sees the "
                                            "request: cancel_requested)", CANCELLED_EXAMPLE), **_JOB_ERRORS})
async def cancel_job(job_id: str, state: StateDep, tenant: TenantDep) -> Job:
    """A queued job is cancelled at once; a running one when its worker sees the request (between
    tensors). Either way its upload, artifact and report are deleted. On a job that has already
    finished it deletes the artifact and report (then 410) and leaves the job as it was, its result
    included: the way to free a finished job's storage before its TTL."""
    return await state.jobs.cancel(tenant, job_id)


@router.get("/{job_id}/files", response_model=FileList, summary="The output's files: path, bytes, sha256",
            responses={200: json_example("A directory output's files (one entry for a one-file job)", {"files": [
                {"path": "config.json", "bytes": 1093, "sha256": "9f2c..."},
                {"path": "model.safetensors", "bytes": 54174842, "sha256": "4b1e..."}]}),
                       **_JOB_ERRORS, **problem_responses(409)})
async def job_files(job_id: str, state: StateDep, tenant: TenantDep) -> FileList:
    return FileList.model_validate({"files": await state.jobs.files(tenant, job_id)})


@router.head("/{job_id}/files/{path:path}", summary="One output file's headers (size, ETag, ranges), no body",
             response_class=Response, openapi_extra=_ARTIFACT_HEADERS,
             responses={200: ARTIFACT_HEAD_200, 206: ARTIFACT_HEAD_206, 304: _ARTIFACT_304, **_ARTIFACT_ERRORS})
async def job_file_head(job_id: str, path: str, request: Request, state: StateDep, tenant: TenantDep) -> Response:
    return await job_file(job_id, path, request, state, tenant)


@router.get("/{job_id}/files/{path:path}", summary="One output file, streamed; ETag = its sha256; Range honoured",
            response_class=Response, openapi_extra=_ARTIFACT_HEADERS,
            responses={200: ARTIFACT_200, 206: ARTIFACT_206, 304: _ARTIFACT_304, **_ARTIFACT_ERRORS})
async def job_file(job_id: str, path: str, request: Request, state: StateDep, tenant: TenantDep) -> Response:
    art, window = await state.jobs.output_file(tenant, job_id, path)
    name = path.rsplit("/", 1)[-1]
    offset, size = window if window is not None else (0, art.size)
    try:
        if window is None and art.path is not None:
            return file_response(request, art.path, etag_hex=art.sha256, filename=name)
        return ranged_response(request, size,
                               lambda start, length: iterate_in_threadpool(art.read(offset + start, length)),
                               etag_hex=art.sha256, filename=name)
    except FileNotFoundError:
        raise ProblemException(410, f"the files of job {job_id!r} are gone", title="Job files expired",
                               type_="urn:quantd:job-expired") from None
