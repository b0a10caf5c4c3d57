"""Synchronous endpoints: quantize (artifact + Quantd-Summary), analyze, calibrate; the sync limit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quantd_client._artifact import read_artifact

from .conftest import CONFIG, assert_problem, npy_bytes, pt_bytes, st_bytes


def _files(data: bytes, name: str = "m.safetensors") -> dict[str, tuple[str, bytes, str]]:
    return {"file": (name, data, "application/octet-stream")}


async def test_quantize_returns_the_artifact_and_a_summary(server):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    r = await server.client.post("/v1/quantize", files=_files(st_bytes({"w": w, "b": torch.zeros(16)})),
                                 data={"config": json.dumps(CONFIG)})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    summary = json.loads(r.headers["quantd-summary"])
    assert summary["tensors_quantized"] == 1 and summary["tensors_skipped"] == 1
    assert 0 < summary["output_bytes"] <= len(r.content)
    deq = read_artifact(r.content).dequantize()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.5
    assert np.all(np.abs(deq["w"] - w.numpy()) <= scale.numpy() / 2 * 1.01 + 1e-7)
    assert np.array_equal(deq["b"], np.zeros(16, dtype=np.float32))
    assert list(server.settings.tmp_dir.iterdir()) == []  # upload and artifact temp files deleted
    text = (await server.client.get("/metrics")).text
    assert "quantd_quantized_bytes_total" in text


async def test_quantize_npy_and_pt_inputs(server):
    arr = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    for data, name in ((npy_bytes(arr), "emb.npy"), (pt_bytes({"w": torch.from_numpy(arr)}), "m.pt")):
        r = await server.client.post("/v1/quantize", files=_files(data, name), data={"config": json.dumps(CONFIG)})
        assert r.status_code == 200, r.text
        assert set(read_artifact(r.content).dequantize()) == {"emb" if name.endswith(".npy") else "w"}


async def test_quantize_above_the_sync_limit_points_to_jobs(make_server):
    async with make_server(max_sync_bytes=4096) as h:
        big = st_bytes({"w": torch.randn(64, 64)})
        body = assert_problem(await h.client.post("/v1/quantize", files=_files(big),
                                                  data={"config": json.dumps(CONFIG)}), 413)
        assert "/v1/jobs" in body["detail"]
        assert (await h.submit(big)).status_code == 202  # the same file is fine as a job
        assert list(h.settings.tmp_dir.glob("upload-*")) == []


async def test_analyze_returns_results_in_config_order(server):
    configs = [{"dtype": "int8", "granularity": "channel"}, {"dtype": "int4", "group_size": 32},
               {"dtype": "int2", "group_size": 32}]
    r = await server.client.post("/v1/analyze", files=_files(st_bytes()), data={"configs": json.dumps(configs)})
    assert r.status_code == 200, r.text
    (t,) = r.json()["tensors"]
    assert t["name"] == "layer.weight" and t["shape"] == [16, 64]
    assert [x["scheme"]["dtype"] for x in t["results"]] == ["int8", "int4", "int2"]
    sqnr = [x["stats"]["sqnr_db"] for x in t["results"]]
    assert sqnr[0] > sqnr[1] > sqnr[2]


async def test_analyze_runs_the_requested_analyses_on_the_first_scheme(server):
    configs = [{"dtype": "int4", "group_size": 32, "symmetric": True}, {"dtype": "int8", "granularity": "channel"}]
    r = await server.client.post("/v1/analyze", files=_files(st_bytes()),
                                 data={"configs": json.dumps(configs),
                                       "analyses": json.dumps(["bit_widths", "outlier_impact", "scale_sensitivity"])})
    assert r.status_code == 200, r.text
    (t,) = r.json()["tensors"]
    a = t["analyses"]
    assert [b["dtype"] for b in a["bit_widths"]] == ["int8", "int4", "int3", "int2"]
    measured = [b["sqnr_db"] for b in a["bit_widths"]]
    assert measured == sorted(measured, reverse=True)  # more bits, less error
    # the int4 row of the comparison is the first scheme itself
    assert a["bit_widths"][1]["stats"]["mse"] == pytest.approx(t["results"][0]["stats"]["mse"])
    assert a["outlier_impact"][0]["percentile"] == 100.0 and a["outlier_impact"][0]["clipped_fraction"] == 0.0
    assert all(x["relative_mse_change"] is not None for x in a["scale_sensitivity"])
    # without the field there are no analyses; an unknown analysis is a 422 naming the field
    r = await server.client.post("/v1/analyze", files=_files(st_bytes()), data={"configs": json.dumps(configs)})
    assert r.json()["tensors"][0]["analyses"] is None
    body = assert_problem(await server.client.post(
        "/v1/analyze", files=_files(st_bytes()),
        data={"configs": json.dumps(configs), "analyses": json.dumps(["vibes"])}), 422)
    assert body["errors"][0]["loc"][:2] == ["body", "analyses"]


async def test_analyze_rejects_more_than_16_configs_and_bad_schemes(server):
    r = await server.client.post("/v1/analyze", files=_files(st_bytes()),
                                 data={"configs": json.dumps([{"dtype": "int8"}] * 17)})
    body = assert_problem(r, 422)
    assert body["errors"][0]["loc"][:2] == ["body", "configs"]
    r = await server.client.post("/v1/analyze", files=_files(st_bytes()),
                                 data={"configs": json.dumps([{"dtype": "int8"}, {"dtype": "int5"}])})
    body = assert_problem(r, 422)
    assert body["errors"][0]["loc"][:4] == ["body", "configs", 1, "dtype"]
    r = await server.client.post("/v1/analyze", files=_files(st_bytes()),  # a cross-field refusal: its field too
                                 data={"configs": json.dumps([{"dtype": "int8"}, {"dtype": "uint4", "symmetric": True}])})
    assert assert_problem(r, 422)["errors"][0]["loc"] == ["body", "configs", 1, "symmetric"]


async def test_calibrate_returns_one_layer_per_tensor(server):
    acts = {"l1": torch.linspace(-2, 6, 400).reshape(50, 8), "l2": torch.rand(20, 4) * 3}
    spec = {"dtype": "uint8", "symmetric": False, "observer": "minmax"}
    r = await server.client.post("/v1/calibrate", files=_files(st_bytes(acts)), data={"observer": json.dumps(spec)})
    assert r.status_code == 200, r.text
    layers = {x["name"]: x for x in r.json()["layers"]}
    assert set(layers) == {"l1", "l2"}
    assert layers["l1"]["min"] == -2.0 and layers["l1"]["max"] == 6.0
    assert layers["l1"]["num_samples"] == 50
    # (max − min) / 255, stored in fp16: within one fp16 step (2**-15 here) of the exact value
    assert abs(layers["l1"]["scale"] - 8.0 / 255) <= 2**-15
    body = assert_problem(await server.client.post(
        "/v1/calibrate", files=_files(st_bytes(acts)), data={"observer": json.dumps({"observer": "magic"})}), 422)
    assert body["errors"][0]["loc"][:3] == ["body", "observer", "observer"]
