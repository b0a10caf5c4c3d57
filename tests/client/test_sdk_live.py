"""Happy paths against a real server (sync and async clients): quantize → dequantize,
submit → wait → download → report, analyze, calibrate, auth, typed errors from real problems."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import pytest

from quantd_client import QuantConfig, Scheme
from quantd_client import _exceptions as ex
from quantd_client._async import AsyncClient
from quantd_client._client import Client

pytestmark = pytest.mark.slow
RNG = np.random.default_rng(0)
W = RNG.standard_normal((32, 128)).astype(np.float32)


def check_int8_per_row(x: np.ndarray, deq: np.ndarray) -> None:
    """Symmetric per-row int8: every row is integer multiples of one scale ≈ absmax/127.5 (±float16
    rounding of the scale), and no element is off by more than half a step."""
    step = np.abs(x).max(axis=1, keepdims=True) / 127.5
    assert np.all(np.abs(deq - x) <= step / 2 * 1.002 + 1e-7)
    unit = np.abs(deq).max(axis=1, keepdims=True) / np.abs(np.round(deq / step)).max(axis=1, keepdims=True)
    codes = deq / unit
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
    assert np.all(np.abs(np.round(codes)) <= 128)


def test_quantize_array_and_dequantize(live_url: str, api_key: str) -> None:
    cfg = QuantConfig(scheme=Scheme(dtype="int8", symmetric=True, granularity="channel"))
    with Client(live_url, api_key=api_key) as c:
        art = c.quantize(W, cfg, name="w")
    assert art.summary is not None and art.summary.tensors_quantized == 1
    out = art.dequantize()
    assert set(out) == {"w"} and out["w"].shape == W.shape
    check_int8_per_row(W, out["w"])
    assert art.metadata["tensors"]["w"]["dtype"] == "int8"


def test_quantize_path_to_output_file(live_url: str, api_key: str, tmp_path: Path) -> None:
    src = tmp_path / "m.npz"
    np.savez(src, **{"a.weight": W, "a.bias": np.ones(32, np.float32)})
    dst = tmp_path / "m.quantd.safetensors"
    with Client(live_url, api_key=api_key) as c:
        art = c.quantize(src, {"scheme": {"dtype": "int4", "group_size": 64}}, output=dst)
    assert art.path == dst and dst.stat().st_size == art.nbytes > 0
    out = art.dequantize()
    np.testing.assert_array_equal(out["a.bias"], np.ones(32, np.float32))  # 1-D: kept as is
    err = out["a.weight"] - W
    assert np.abs(err).max() < np.abs(W).max() / 7  # int4 asymmetric: half a step of a 15-step range, at most


def test_submit_wait_download_report(live_url: str, api_key: str, tmp_path: Path) -> None:
    src = tmp_path / "model.npz"
    np.savez(src, **{"l1.weight": W, "l2.weight": W[:, :64] * 3})
    dst = tmp_path / "model.quantd.safetensors"
    with Client(live_url, api_key=api_key) as c:
        job = c.submit(src, {"scheme": {"dtype": "int4", "group_size": 32}}, progress=False)
        assert job.status in ("queued", "running", "succeeded")
        job = job.wait(timeout=120, progress=False)
        assert job.status == "succeeded", job.error
        path = job.download(dst, progress=False)
        report = job.report()
        assert any(j.id == job.id for j in c.list_jobs(limit=20))
    data = path.read_bytes()
    assert job.result is not None and hashlib.sha256(data).hexdigest() == job.result.artifact_sha256
    assert {t.name for t in report.tensors} == {"l1.weight", "l2.weight"}
    assert all(t.stats is not None and t.stats.sqnr_db is not None and t.stats.sqnr_db > 15 for t in report.tensors)


def test_resume_download_against_real_range_support(live_url: str, api_key: str, tmp_path: Path) -> None:
    src = tmp_path / "w.npy"
    np.save(src, W)
    with Client(live_url, api_key=api_key) as c:
        job = c.submit(src, {"scheme": {"dtype": "int8"}}).wait(timeout=120, progress=False)
        full = job.download(tmp_path / "full", progress=False).read_bytes()
        (tmp_path / "half.part").write_bytes(full[: len(full) // 2])
        half = job.download(tmp_path / "half", progress=False).read_bytes()
        # a partial file that is not the artifact's start: the resumed bytes fail the sha256, and the
        # download starts over once, without failing the call
        (tmp_path / "junk.part").write_bytes(b"\0" * 1000)
        junk = job.download(tmp_path / "junk", progress=False).read_bytes()
        assert not (tmp_path / "junk.part").exists()
    assert half == full and junk == full


def test_async_client_happy_path(live_url: str, api_key: str, tmp_path: Path) -> None:
    src = tmp_path / "w.npy"
    np.save(src, W)

    async def go() -> tuple[np.ndarray, str, int]:
        async with AsyncClient(live_url, api_key=api_key) as c:
            art = await c.quantize(W, {"scheme": {"dtype": "int8", "symmetric": True, "granularity": "channel"}})
            job = await (await c.submit(src, {"scheme": {"dtype": "int8"}})).wait(timeout=120, progress=False)
            path = await job.download(tmp_path / "a.safetensors", progress=False)
            report = await job.report()
            info = await c.info()
            assert "int4" in info.dtypes
            return art.dequantize()["tensor"], hashlib.sha256(path.read_bytes()).hexdigest(), len(report.tensors)

    deq, digest, n = asyncio.run(go())
    check_int8_per_row(W, deq)
    assert n == 1 and len(digest) == 64


def test_analyze(live_url: str, api_key: str) -> None:
    with Client(live_url, api_key=api_key) as c:
        resp = c.analyze({"w": W}, [{"dtype": "int8"}, {"dtype": "int4", "group_size": 32}])
    (t,) = resp.tensors
    s8, s4 = (r.stats for r in t.results)
    assert s8.sqnr_db is not None and s4.sqnr_db is not None and s8.sqnr_db > s4.sqnr_db + 10


def test_calibrate(live_url: str, api_key: str) -> None:
    act = RNG.standard_normal((8, 16)).astype(np.float32)
    with Client(live_url, api_key=api_key) as c:
        cal = c.calibrate({"act": act}, {"dtype": "int8", "observer": "minmax"})
    (layer,) = cal.layers
    assert layer.name == "act" and layer.num_samples == 8
    assert layer.min == pytest.approx(float(act.min()), rel=1e-5)


def test_real_errors_are_typed(live_url: str, api_key: str, tmp_path: Path) -> None:
    with Client(live_url, api_key="wrong-key-123", max_retries=0) as c, pytest.raises(ex.AuthError) as auth:
        c.info()
    assert auth.value.status == 401 and auth.value.request_id
    with Client(live_url, api_key=api_key, max_retries=0) as c:
        with pytest.raises(ex.NotFound):
            c.get_job("no-such-job")
        with pytest.raises(ex.ValidationError, match="group_size"):
            c.quantize(W, {"scheme": {"dtype": "int4", "group_size": 48}})
        bad = tmp_path / "x.bin"
        bad.write_bytes(b"definitely not weights")
        with pytest.raises(ex.UnsupportedMedia):
            c.quantize(bad)


def test_torch_tensors_and_a_bfloat16_state_dict_upload_as_safetensors(live_url: str, api_key: str) -> None:
    """A tensor, and a module's ``state_dict()`` or parameters (bfloat16, requiring grad) go up as one
    safetensors file: names and dtypes as the caller holds them."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    cfg = {"scheme": {"dtype": "int8", "granularity": "channel", "symmetric": True}}
    with Client(live_url, api_key=api_key) as c:
        art = c.quantize(torch.from_numpy(W), cfg, name="w")
        check_int8_per_row(W, art.dequantize()["w"])
        art = c.quantize(model.state_dict(), cfg)
        params = c.quantize(dict(model.named_parameters()), cfg)
        job = c.submit(model.state_dict(), cfg, progress=False).wait(timeout=120, progress=False)
        assert job.status == "succeeded", job.error
    assert job.model.input.format == "safetensors" and job.model.input.filename == "tensors.safetensors"
    assert params.dequantize().keys() == art.dequantize().keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    tensors = art.metadata["tensors"]
    assert tensors["0.weight"]["orig_dtype"] == "bfloat16" and tensors["0.weight"]["dtype"] == "int8"
    ref = model.state_dict()["0.weight"].float().numpy()
    deq = art.dequantize()["0.weight"]
    assert np.abs(deq - ref).max() <= np.abs(ref).max() / 127
