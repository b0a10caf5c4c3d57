"""OpenAPI fragments for the routes whose multipart bodies are parsed by hand (streamed), so
FastAPI cannot infer them: request bodies with their JSON field schemas, binary responses, headers."""

from __future__ import annotations

from typing import Any

from quantd_client import ObserverSpec, QuantConfig, Scheme
from quantd_client._schemas import JobByReference

from ..problems import problem_responses

# Models referenced from multipart fields; app.py adds them to components.schemas.
FORM_MODELS = (QuantConfig, Scheme, ObserverSpec, JobByReference)

_FILE = {"type": "string", "format": "binary",
         "description": "safetensors, PyTorch state dict (.pt/.pth/.bin, weights-only), .npy or .npz; "
                        "recognised by magic bytes. The filename is display-only."}


def _ref(model: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def multipart_body(fields: dict[str, dict[str, Any]], required: list[str], json_fields: list[str],
                   example: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {
        "schema": {"type": "object", "required": required, "properties": fields},
        "encoding": {f: {"contentType": "application/json"} for f in json_fields},
        "example": example,
    }}}}


CONFIG_EXAMPLE = {"scheme": {"dtype": "int4", "granularity": "group", "group_size": 128}}

QUANTIZE_BODY = multipart_body(
    {"file": _FILE, "config": {**_ref(QuantConfig), "description": "QuantConfig as a JSON string"}},
    ["file", "config"], ["config"], {"file": "(binary)", "config": CONFIG_EXAMPLE})

_DIRECTORY_FILES = {
    "type": "array", "minItems": 2, "items": {"type": "string", "format": "binary"},
    "description": "a model directory: one part per file, each filename the file's relative POSIX path "
                   "(config.json, model-00001-of-00002.safetensors, model.safetensors.index.json, ...); a path that "
                   "is absolute, has '..', '.' or empty components, backslashes or control characters, comes "
                   "twice, or is also a folder of another path is refused with 422 naming it; the size limit "
                   "applies to the sum"}

JOB_BODY = multipart_body(
    {"file": {"anyOf": [_FILE, _DIRECTORY_FILES],
              "description": "one weight file (a one-file job), or several parts: a model directory"},
     "config": {**_ref(QuantConfig), "description": "QuantConfig as a JSON string"},
     "calibration": {**_FILE, "description": "optional: activation samples (name → [N, ...]); for the gptq "
                                               "and awq methods, per Linear module M its input rows M [N, in] "
                                               "or M.hessian [in, in] with M.hessian_count; with a model "
                                               "directory also JSONL, {\"text\": ...} or {\"input_ids\": "
                                               "[...]} a line, that the worker runs the model on "
                                               "(config.calibration); for GGUF output an importance matrix"}},
    ["file", "config"], ["config"], {"file": "(binary)", "config": CONFIG_EXAMPLE})
# Or, as JSON, a job by reference: the server reads the s3:// source itself (CONTRACT §11).
JOB_BODY["requestBody"]["content"]["application/json"] = {
    "schema": _ref(JobByReference),
    "example": {"config": CONFIG_EXAMPLE, "source": "s3://models/llama/model.safetensors",
                "destination": "s3://models/llama-int4/"}}

ANALYZE_BODY = multipart_body(
    {"file": _FILE, "configs": {"type": "array", "items": _ref(Scheme), "minItems": 1, "maxItems": 16,
                                "description": "JSON list of schemes; results come back in this order"},
     "analyses": {"type": "array", "maxItems": 3,
                  "items": {"type": "string", "enum": ["bit_widths", "outlier_impact", "scale_sensitivity"]},
                  "description": "optional: analyses run on the first scheme, per tensor (bit-width "
                                 "comparison, outlier impact of percentile clipping, scale sensitivity)"}},
    ["file", "configs"], ["configs", "analyses"],
    {"file": "(binary)", "configs": [{"dtype": "int8", "granularity": "channel"}, {"dtype": "int4"}],
     "analyses": ["bit_widths"]})

CALIBRATE_BODY = multipart_body(
    {"file": {**_FILE, "description": "activation samples: tensor name → [N, ...]"},
     "observer": {**_ref(ObserverSpec), "description": "ObserverSpec as a JSON string"}},
    ["file", "observer"], ["observer"],
    {"file": "(binary)", "observer": {"dtype": "int8", "symmetric": False, "observer": "percentile",
                                      "observer_args": {"percentile": 99.99}}})

UPLOAD_ERRORS = problem_responses(400, 401, 408, 413, 415, 422, 500, 503, 507)

_STRING = {"type": "string"}
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_FILE_HEADERS = {
    "ETag": {"description": "The artifact's sha256 in hex, quoted (a strong ETag)", "schema": _STRING,
             "example": '"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"'},
    "Accept-Ranges": {"description": "Single byte ranges are honoured", "schema": _STRING, "example": "bytes"},
    "Content-Length": {"schema": {"type": "integer"}},
    "Content-Disposition": {"schema": _STRING, "example": 'attachment; filename="<id>.quantd.safetensors"'},
}
_RANGE_HEADERS = {**_FILE_HEADERS, "Content-Range": {"schema": _STRING, "example": "bytes 0-1023/4096"}}

# A one-file job's artifact is its output file; a directory job's is the whole output as one tar (CONTRACT §8).
_ARTIFACT_CONTENT = {**_BINARY, "application/x-tar": {"schema": {"type": "string", "format": "binary"}}}
ARTIFACT_200 = {"description": "The artifact: the output file (safetensors CONTRACT §5, GGUF), or for a "
                               "directory job the output directory as one uncompressed tar",
                "headers": _FILE_HEADERS, "content": _ARTIFACT_CONTENT}
ARTIFACT_206 = {"description": "Partial content: the one range asked for", "headers": _RANGE_HEADERS,
                "content": _ARTIFACT_CONTENT}
# QUANTD_STORAGE_PRESIGN: the object store serves the bytes.
ARTIFACT_307 = {"description": "With presigned downloads on: the artifact at a presigned object-store URL (send "
                               "no API key there); the ETag is the artifact's sha256",
                "headers": {"Location": {"description": "The presigned URL", "schema": _STRING},
                            "ETag": _FILE_HEADERS["ETag"]}}
# HEAD: the headers GET would send, no body.
ARTIFACT_HEAD_200 = {"description": "The artifact's headers, no body", "headers": _FILE_HEADERS}
ARTIFACT_HEAD_206 = {"description": "The headers of the range asked for, no body", "headers": _RANGE_HEADERS}

# The conditional and range request headers the artifact download honours.
ARTIFACT_PARAMETERS = [
    {"name": "Range", "in": "header", "required": False, "schema": _STRING, "example": "bytes=1024-",
     "description": "One byte range (bytes=a-b, bytes=a-, bytes=-n) → 206; past the end → 416; several "
                    "ranges or a malformed header → the whole file (RFC 9110)"},
    {"name": "If-Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "The ETag of the copy being resumed: Range is honoured only when it still matches"},
    {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "An ETag (or *): 304 with no body when it matches"},
    {"name": "If-Match", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "ETags (or *): 412 when none is the file's (strong comparison)"},
]

SYNC_FILE_HEADERS = {"ETag": _FILE_HEADERS["ETag"], "Content-Disposition": {
    "schema": _STRING, "example": 'attachment; filename="w.quantd.safetensors"'}}
SUMMARY_HEADER = {"Quantd-Summary": {
    "description": "Compact JSON of the Summary (tensors_quantized, compression_ratio, mean_sqnr_db, ...)",
    "schema": {"type": "string"}}}


def finish_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the models referenced by multipart fields to ``components.schemas``, and document every
    422 as the problem+json it is (FastAPI's default names its own HTTPValidationError body)."""
    problem_422 = problem_responses(422)[422]
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            resp = op.get("responses", {})
            if "422" in resp and "application/json" in resp["422"].get("content", {}):
                resp["422"] = problem_422
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    for model in FORM_MODELS:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in js.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps.setdefault(model.__name__, js)
    return schema


def without_auth(schema: dict[str, Any]) -> dict[str, Any]:
    """The document of a server running open (no API keys): no security scheme, no ``security`` requirement
    and no 401 answer on any operation, since none is asked for or given."""
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            if isinstance(op, dict):
                op.pop("security", None)
                op.get("responses", {}).pop("401", None)
    comps = schema.get("components", {})
    comps.pop("securitySchemes", None)
    return schema


JOB_EXAMPLE: dict[str, Any] = {
    "id": "3f2c9b7e0a4d4c1e9f6b2a8d7c5e4f10", "status": "queued", "created_at": "2026-01-01T12:00:00Z",
    "started_at": None, "finished_at": None,
    "input": {"filename": "model.safetensors", "bytes": 268435456, "sha256": "9f86d081884c7d65...",
              "format": "safetensors", "tensors": 291},
    "config": CONFIG_EXAMPLE,
    "progress": {"tensors_done": 0, "tensors_total": 291, "bytes_done": 0, "bytes_total": 268435456,
                 "fraction": 0.0},
    "device": "cpu", "result": None, "error": None, "attempts": 0,
}

STATS_EXAMPLE: dict[str, Any] = {
    "numel": 147456, "mse": 1.02e-06, "mae": 8.1e-04, "max_abs_error": 2.29e-03, "sqnr_db": 33.4,
    "cosine": 0.99977, "outlier_rate": 0.0031, "outlier_threshold": 0.119, "clipped_fraction": 0.0,
    "theoretical_max_error": 2.29e-03, "bits_per_weight": 8.0625, "compression_ratio": 3.969,
    "theoretical_sqnr_db": 49.92,
}

SUMMARY_EXAMPLE: dict[str, Any] = {
    "tensors_quantized": 36, "tensors_skipped": 65, "input_bytes": 90868376, "output_bytes": 23289936,
    "compression_ratio": 3.902, "bits_per_weight": 8.0625, "mean_sqnr_db": 33.9, "min_sqnr_db": 31.2,
    "worst_tensor": "encoder.layer.5.output.dense.weight", "elapsed_s": 1.84, "device": "cpu",
}

INFO_EXAMPLE: dict[str, Any] = {
    "version": "1.0.0", "devices": [{"name": "cpu", "type": "cpu", "memory_bytes": 25769803776}],
    "dtypes": ["int8", "int4", "int3", "int2", "uint8", "uint4", "nf4", "fp8_e4m3", "fp8_e5m2", "float16",
               "bfloat16"],
    "observers": ["minmax", "percentile", "meanstd", "ema", "mse", "entropy"],
    "methods": ["rtn", "hqq", "gptq", "awq"],
    "method_args": [{"name": "gptq", "needs": "hessian", "description": "GPTQ: columns rounded in turn, ...",
                     "args": [{"name": "act_order", "type": "bool", "default": True, "min": None, "max": None,
                               "description": "visit columns by decreasing Hessian diagonal"}]}],
    "granularities": ["tensor", "channel", "group"],
    "input_formats": ["safetensors", "pytorch", "npy", "npz", "gguf"], "output_formats": ["safetensors", "compressed-tensors", "gguf"],
    "gguf_mixes": ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0",
                   "Q4_0", "Q4_1", "Q5_0", "Q5_1"],
    "limits": {"max_upload_bytes": 10737418240, "max_sync_bytes": 268435456, "max_analyze_configs": 16,
               "max_queue": 1000},
    "auth": True,
}

ANALYZE_EXAMPLE: dict[str, Any] = {"tensors": [{
    "name": "encoder.layer.0.attention.self.query.weight", "shape": [384, 384],
    "results": [{"scheme": {"dtype": "int8", "granularity": "channel"}, "stats": STATS_EXAMPLE}],
}]}

REPORT_EXAMPLE: dict[str, Any] = {
    "job_id": "3f2c9b7e0a4d4c1e9f6b2a8d7c5e4f10", "config": {"scheme": {"dtype": "int8", "granularity": "channel"}},
    "summary": SUMMARY_EXAMPLE,
    "tensors": [
        {"name": "encoder.layer.0.attention.self.query.weight", "shape": [384, 384], "in_dtype": "float32",
         "scheme": {"dtype": "int8", "granularity": "channel"}, "stats": STATS_EXAMPLE, "skipped": False,
         "reason": None},
    ],  # (a skipped tensor has "skipped": true, a "reason", and null scheme and stats)
}

CALIBRATE_EXAMPLE: dict[str, Any] = {"layers": [{
    "name": "encoder.layer.0.attention.self.query", "min": -3.91, "max": 4.27, "scale": 0.0320784,
    "zero_point": -6, "observer": "percentile", "num_samples": 512,
}]}

CANCELLED_EXAMPLE: dict[str, Any] = {**JOB_EXAMPLE, "status": "cancelled", "finished_at": "2026-01-01T12:00:09Z"}


def json_example(description: str, example: Any) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"example": example}}}
