"""Methods over HTTP: /v1/info lists them with their arguments; a GPTQ job with a calibration file; the
422s a method's config earns before the job is accepted."""

from __future__ import annotations

import json
from typing import get_args

import pytest
import torch

from quantd_client._artifact import read_artifact
from quantd_client._schemas import MethodName

from .conftest import assert_problem, st_bytes


def _files(calibration: bytes | None) -> dict[str, tuple[str, bytes, str]]:
    g = torch.Generator().manual_seed(0)
    files = {"file": ("m.safetensors", st_bytes({"enc.q.weight": torch.randn(16, 64, generator=g),
                                                  "enc.q.bias": torch.randn(16, generator=g)}),
                      "application/octet-stream")}
    if calibration is not None:
        files["calibration"] = ("cal.safetensors", calibration, "application/octet-stream")
    return files


def _rows() -> bytes:
    return st_bytes({"enc.q": torch.randn(200, 64, generator=torch.Generator().manual_seed(1))})


async def test_info_lists_every_method_with_its_arguments(server):
    info = (await server.client.get("/v1/info")).json()
    assert info["methods"] == list(get_args(MethodName))
    by_name = {m["name"]: m for m in info["method_args"]}
    assert set(by_name) == set(info["methods"])
    assert by_name["gptq"]["needs"] == "hessian" and by_name["hqq"]["needs"] == "none"
    assert {a["name"] for a in by_name["gptq"]["args"]} >= {"damp", "act_order", "block_size"}
    for m in info["method_args"]:  # each default and bound in its argument's type: 128, not 128.0
        for a in m["args"]:
            kind = {"int": int, "float": (int, float), "bool": bool}[a["type"]]
            assert isinstance(a["default"], kind) and (a["type"] != "int" or not isinstance(a["default"], bool)), a
            assert all(v is None or isinstance(v, int if a["type"] == "int" else (int, float))
                       for v in (a["min"], a["max"])), a


async def test_a_job_echoes_method_args_in_the_types_given(server):
    args = {"iters": 3, "beta": 1000.0, "lp_norm": 0.7}
    config = {"scheme": {"dtype": "int4", "group_size": 32, "method": "hqq", "method_args": args}}
    r = await server.client.post("/v1/jobs", files=_files(None), data={"config": json.dumps(config)})
    assert r.status_code == 202, r.text
    echoed = json.loads(r.text)["config"]["scheme"]["method_args"]  # parsed as sent: 3, not 3.0
    assert echoed == args and type(echoed["iters"]) is int and type(echoed["beta"]) is float


@pytest.mark.parametrize("args", ['{"damp": NaN}', '{"lp_norm": Infinity}', '{"iters": "3"}',
                                  '{"act_order": "yes"}'])
async def test_a_method_argument_that_is_no_finite_number_or_boolean_is_a_422_and_no_job(server, args):
    """NaN passed the range checks: a 500 answered a job that was created and ran."""
    method = "hqq" if "lp_norm" in args or "iters" in args else "gptq"
    config = (f'{{"scheme": {{"dtype": "int4", "group_size": 32, "method": "{method}", "method_args": {args}}}}}')
    r = await server.client.post("/v1/jobs", files=_files(_rows()), data={"config": config})
    body = assert_problem(r, 422)
    assert "method_args" in json.dumps(body["errors"]), body
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_gptq_job_with_a_calibration_file(server):
    config = {"scheme": {"dtype": "int4", "group_size": 32, "method": "gptq", "method_args": {"act_order": True}}}
    r = await server.client.post("/v1/jobs", files=_files(_rows()), data={"config": json.dumps(config)})
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"])
    assert job["status"] == "succeeded", job
    rep = (await server.client.get(f"/v1/jobs/{job['id']}/report")).json()
    (weight,) = [t for t in rep["tensors"] if t["name"] == "enc.q.weight"]
    assert 0.0 < weight["stats"]["output_rel_error"] < 0.05
    assert rep["activations"] is None  # the file served the method, not activation ranges
    art = read_artifact((await server.client.get(f"/v1/jobs/{job['id']}/artifact")).content)
    assert "enc.q.weight.g_idx" in art.tensor_names
    assert art.dequantize("enc.q.weight")["enc.q.weight"].shape == (16, 64)


async def test_method_configs_that_cannot_run_are_refused_before_the_job(server):
    gptq = {"scheme": {"dtype": "int4", "group_size": 32, "method": "gptq"}}
    body = assert_problem(await server.client.post("/v1/jobs", files=_files(None),
                                                   data={"config": json.dumps(gptq)}), 422)
    assert "enc.q.weight" in body["detail"] and "needs calibration" in body["detail"], body
    bad_arg = {"scheme": {"dtype": "int4", "group_size": 32, "method": "hqq", "method_args": {"damp": 0.1}}}
    body = assert_problem(await server.client.post("/v1/jobs", files=_files(None),
                                                   data={"config": json.dumps(bad_arg)}), 422)
    assert "method_args" in body["detail"] and "damp" in body["detail"], body
    narrow = st_bytes({"enc.q": torch.randn(10, 32)})
    body = assert_problem(await server.client.post("/v1/jobs", files=_files(narrow),
                                                   data={"config": json.dumps(gptq)}), 422)
    assert "32 input features" in body["detail"], body
    r = await server.client.get("/v1/jobs")
    assert r.json()["items"] == []


async def test_hqq_over_the_sync_endpoint(server):
    config = {"scheme": {"dtype": "int4", "group_size": 32, "method": "hqq"}}
    r = await server.client.post("/v1/quantize", files=_files(None), data={"config": json.dumps(config)})
    assert r.status_code == 200, r.text
    art = read_artifact(r.content)
    assert art.metadata["tensors"]["enc.q.weight"]["zero_point_domain"] == "float"


def _hessian(h: torch.Tensor, count: int = 200) -> bytes:
    return st_bytes({"enc.q.hessian": h, "enc.q.hessian_count": torch.tensor(count)})


def _spd(seed: int = 2) -> torch.Tensor:
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(seed))
    return x.T @ x


def _with(x: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize(("case", "tensor", "needle"), [
    ("nan-rows", "enc.q", "NaN or Inf"),
    ("inf-rows", "enc.q", "NaN or Inf"),
    ("nan-hessian", "enc.q.hessian", "NaN or Inf"),
    ("zero-count", "enc.q.hessian_count", "≥ 1"),
    ("negative-count", "enc.q.hessian_count", "≥ 1"),
    ("negative-diagonal", "enc.q.hessian", "diagonal"),
    ("negative-definite", "enc.q.hessian", "diagonal"),
])
async def test_calibration_values_that_cannot_serve_are_422_before_the_job(server, method, case, tensor, needle):
    rows = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    calibration = {
        "nan-rows": lambda: st_bytes({"enc.q": _with(rows, (150, 3), float("nan"))}),
        "inf-rows": lambda: st_bytes({"enc.q": _with(rows, (0, 63), float("-inf"))}),
        "nan-hessian": lambda: _hessian(_with(_spd(), (5, 7), float("nan"))),
        "zero-count": lambda: _hessian(_spd(), 0),
        "negative-count": lambda: _hessian(_spd(), -3),
        "negative-diagonal": lambda: _hessian(_with(_spd(), (9, 9), -1.0)),
        "negative-definite": lambda: _hessian(-_spd()),
    }[case]()
    config = {"scheme": {"dtype": "int4", "group_size": 32, "method": method}}
    r = await server.client.post("/v1/jobs", files=_files(calibration), data={"config": json.dumps(config)})
    body = assert_problem(r, 422)
    assert repr(tensor) in body["detail"] and needle in body["detail"], body["detail"]
    assert "calibration" in body["detail"], body["detail"]
    assert (await server.client.get("/v1/jobs")).json()["items"] == []
