"""OpenAPI fragments for the routes whose multipart bodies are parsed by hand (streamed), so
FastAPI cannot infer them: request bodies with their JSON field schemas, binary responses, headers."""

from __future__ import annotations

from typing import Any

from quantd_client import ObserverSpec, QuantConfig, Scheme

from ..problems import problem_responses

# Models referenced from multipart fields; app.py adds them to components.schemas.
FORM_MODELS = (QuantConfig, Scheme, ObserverSpec)

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

JOB_BODY = multipart_body(
    {"file": _FILE, "config": {**_ref(QuantConfig), "description": "QuantConfig as a JSON string"},
     "calibration": {**_FILE, "description": "optional activation samples (name → [N, ...])"}},
    ["file", "config"], ["config"], {"file": "(binary)", "config": CONFIG_EXAMPLE})

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

UPLOAD_ERRORS = problem_responses(400, 401, 413, 415, 422, 500)

ARTIFACT_200 = {
    "description": "The artifact (safetensors, CONTRACT §5)",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}

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


JOB_EXAMPLE: dict[str, Any] = {
    "id": "3f2c9b7e0a4d4c1e9f6b2a8d7c5e4f10", "status": "queued", "created_at": "2026-01-01T12:00:00Z",
    "started_at": None, "finished_at": None,
    "input": {"filename": "model.safetensors", "bytes": 268435456, "sha256": "9f86d081884c7d65...",
              "format": "safetensors", "tensors": 291},
    "config": CONFIG_EXAMPLE,
    "progress": {"tensors_done": 0, "tensors_total": 291, "bytes_done": 0, "bytes_total": 268435456,
                 "fraction": 0.0},
    "device": None, "result": None, "error": None, "attempts": 0,
}


def json_example(description: str, example: Any) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"example": example}}}
