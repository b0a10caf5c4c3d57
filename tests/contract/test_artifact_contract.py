"""CONTRACT §4/§5 from outside: an artifact reader written from §5 alone (struct + json + numpy).

One file holds a tensor for every dtype × granularity × symmetric that is valid, each selected by a
rule. It goes through a job (for the §4 report) and through /v1/quantize; every tensor is dequantized
here and checked against the input: the half-step bound, the reported stats recomputed, bits per
weight counted from the stored bytes, and the §5 metadata."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from ._harness import INT_DOMAIN, NF4, Server, dequantize, expand, st_decode, st_encode, wait_job

META_FIELDS = {"dtype", "shape", "orig_dtype", "symmetric", "granularity", "axis", "group_size", "method",
               "observer"}
SUMMARY_FIELDS = {"tensors_quantized", "tensors_skipped", "input_bytes", "output_bytes", "compression_ratio",
                  "bits_per_weight", "mean_sqnr_db", "min_sqnr_db", "worst_tensor", "elapsed_s", "device"}
SHAPE = (64, 256)
GROUP = 64


def _cases() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    for dtype in ("int8", "int4", "int3", "int2", "uint8", "uint4", "nf4", "fp8_e4m3", "fp8_e5m2",
                  "float16", "bfloat16"):
        if dtype.startswith("int"):
            syms: tuple[bool | None, ...] = (True, False)
        elif dtype.startswith("uint"):
            syms = (False,)
        elif dtype in ("nf4", "fp8_e4m3", "fp8_e5m2"):
            syms = (True,)
        else:
            syms = (None,)
        grans = ("tensor",) if dtype in ("float16", "bfloat16") else ("tensor", "channel", "group")
        for gran in grans:
            for sym in syms:
                scheme: dict[str, Any] = {"dtype": dtype, "granularity": gran, "group_size": GROUP}
                if sym is not None:
                    scheme["symmetric"] = sym
                tag = "sym" if sym else ("asym" if sym is False else "na")
                cases.append((f"w.{dtype}.{gran}.{tag}", scheme))
    cases += [
        ("w.int4.group.asym.s32", {"dtype": "int4", "granularity": "group", "group_size": 32,
                                   "symmetric": False, "scale_dtype": "float32"}),
        ("w.int8.channel.sym.sbf16", {"dtype": "int8", "granularity": "channel", "symmetric": True,
                                      "scale_dtype": "bfloat16"}),
        ("conv.int8.channel.axis1", {"dtype": "int8", "granularity": "channel", "axis": 1, "symmetric": True}),
        ("conv.uint8.channel.axis0", {"dtype": "uint8", "granularity": "channel", "axis": 0,
                                      "symmetric": False}),
    ]
    return cases


CASES = dict(_cases())


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {}
    for name in CASES:
        shape = (16, 8, 3, 3) if name.startswith("conv.") else SHAPE
        x = rng.standard_normal(shape).astype(np.float32) * 0.05
        x.reshape(shape[0], -1)[3, :5] *= 40.0  # an outlier row, so channel/group differ from tensor
        x.reshape(shape[0], -1)[5] += 0.1  # an off-centre row, so zero points matter
        out[name] = x
    return out


# ---- fixtures: one job (report + artifact) and one sync quantize of the same file ----

@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    return _inputs()


@pytest.fixture(scope="module")
def model_file(inputs: dict[str, np.ndarray]) -> bytes:
    tensors: dict[str, tuple[str, np.ndarray]] = {n: ("F32", a) for n, a in inputs.items()}
    tensors["keep.bias"] = ("F32", np.linspace(-1, 1, 64, dtype=np.float32))
    tensors["keep.index"] = ("I64", np.arange(12, dtype=np.int64).reshape(3, 4))
    return st_encode(tensors)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    rules = [{"match": n, "scheme": s} for n, s in CASES.items()]
    return {"scheme": {"dtype": "int8", "granularity": "channel"}, "rules": rules}


@pytest.fixture(scope="module")
def job_result(server: Server, model_file: bytes, config: dict[str, Any]) -> dict[str, Any]:
    c = server.client
    r = c.post("/v1/jobs", files={"file": ("grid.safetensors", model_file)}, data={"config": json.dumps(config)})
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"])
    assert job["status"] == "succeeded", job
    report = c.get(f"/v1/jobs/{job['id']}/report").json()
    art = c.get(f"/v1/jobs/{job['id']}/artifact")
    assert art.status_code == 200
    tensors, meta = st_decode(art.content)
    return {"report": report, "tensors": tensors, "meta": json.loads(meta["quantd"])}


@pytest.fixture(scope="module")
def sync_result(server: Server, model_file: bytes, config: dict[str, Any]) -> dict[str, Any]:
    r = server.client.post("/v1/quantize", files={"file": ("grid.safetensors", model_file)},
                           data={"config": json.dumps(config)})
    assert r.status_code == 200, r.text[:500]
    tensors, meta = st_decode(r.content)
    return {"tensors": tensors, "meta": json.loads(meta["quantd"]), "summary": json.loads(r.headers["Quantd-Summary"])}


def _rel(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


@pytest.mark.parametrize("name", list(CASES))
def test_dequantized_matches_reported_stats(name: str, inputs: dict[str, np.ndarray],
                                            job_result: dict[str, Any]) -> None:
    x = inputs[name].astype(np.float64)
    meta = job_result["meta"]["tensors"][name]
    xh, parts = dequantize(job_result["tensors"], name, meta)
    row = next(t for t in job_result["report"]["tensors"] if t["name"] == name)
    assert not row["skipped"] and row["scheme"]["dtype"] == CASES[name]["dtype"]
    stats = row["stats"]
    err = np.abs(x - xh)
    mse = float((err**2).mean())
    assert stats["numel"] == x.size
    assert _rel(stats["mse"], mse, 1e-3, 1e-12), (stats["mse"], mse)
    assert _rel(stats["mae"], float(err.mean()), 1e-3, 1e-9), (stats["mae"], float(err.mean()))
    assert _rel(stats["max_abs_error"], float(err.max()), 1e-3, 1e-7), (stats["max_abs_error"], float(err.max()))
    if mse > 0:
        sqnr = 10 * math.log10(float((x**2).mean()) / mse)
        assert stats["sqnr_db"] is not None and abs(stats["sqnr_db"] - sqnr) < 0.01, (stats["sqnr_db"], sqnr)
    cos = float((x * xh).sum() / (np.linalg.norm(x) * np.linalg.norm(xh)))
    assert abs(stats["cosine"] - cos) < 1e-5, (stats["cosine"], cos)
    # bits per weight: every stored byte of qdata, scale and zero point, per element
    stored = sum(len(parts[k].raw) for k in ("qdata", "zero_point") if k in parts)
    if "scale" in parts:
        stored += len(job_result["tensors"][f"{name}.scale"].raw)
    assert _rel(stats["bits_per_weight"], stored * 8 / x.size, 1e-6), (stats["bits_per_weight"], stored * 8 / x.size)
    assert _rel(stats["compression_ratio"], 32 / stats["bits_per_weight"], 1e-3)


@pytest.mark.parametrize("name", [n for n, s in CASES.items() if s["dtype"] in INT_DOMAIN])
def test_integer_error_within_half_step(name: str, inputs: dict[str, np.ndarray],
                                        job_result: dict[str, Any]) -> None:
    """§4: unclipped elements never exceed theoretical_max_error = half the largest step."""
    x = inputs[name].astype(np.float64)
    meta = job_result["meta"]["tensors"][name]
    xh, parts = dequantize(job_result["tensors"], name, meta)
    stats = next(t for t in job_result["report"]["tensors"] if t["name"] == name)["stats"]
    tme = stats["theoretical_max_error"]
    assert tme is not None
    assert _rel(tme, float(parts["scale"].max()) / 2, 1e-6), (tme, float(parts["scale"].max()) / 2)
    _, qmin, qmax = INT_DOMAIN[CASES[name]["dtype"]]
    codes = parts["codes"]
    unclipped = (codes > qmin) & (codes < qmax)
    assert unclipped.mean() > 0.5
    err = np.abs(x - xh)
    assert err[unclipped].max() <= tme * (1 + 1e-5) + 1e-9, (err[unclipped].max(), tme)
    # a per-element half step too: each element is within half of ITS OWN step
    step = expand(parts["scale"], x.shape, meta)
    assert (err[unclipped] <= step[unclipped] / 2 * (1 + 1e-5) + 1e-9).all()


@pytest.mark.parametrize("name", [n for n, s in CASES.items() if s["dtype"] not in INT_DOMAIN])
def test_float_like_error_bounds(name: str, inputs: dict[str, np.ndarray], job_result: dict[str, Any]) -> None:
    """nf4: within half the widest codebook gap × scale; fp8/float: within a half ulp (relative)."""
    x = inputs[name].astype(np.float64)
    meta = job_result["meta"]["tensors"][name]
    xh, parts = dequantize(job_result["tensors"], name, meta)
    err = np.abs(x - xh)
    dt = CASES[name]["dtype"]
    if dt == "nf4":
        step = expand(parts["scale"], x.shape, meta)
        assert (err <= step * np.diff(NF4).max() / 2 * (1 + 1e-5) + 1e-9).all()
    else:
        man = {"fp8_e4m3": 3, "fp8_e5m2": 2, "float16": 10, "bfloat16": 7}[dt]
        # relative half ulp, plus the subnormal floor of each format (scaled back for fp8)
        tiny = {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16, "float16": 2.0**-24, "bfloat16": 0.0}[dt]
        s = expand(parts["scale"], x.shape, meta) if "scale" in parts else 1.0
        assert (err <= np.abs(x) * 2.0 ** -(man + 1) * (1 + 1e-6) + tiny * s).all()
    if not (dt == "nf4" and CASES[name]["granularity"] == "tensor"):  # one absmax over a 40x outlier row
        assert np.corrcoef(x.ravel(), xh.ravel())[0, 1] > 0.9


@pytest.mark.parametrize("name", list(CASES))
def test_metadata_per_tensor(name: str, job_result: dict[str, Any], sync_result: dict[str, Any]) -> None:
    for res in (job_result, sync_result):
        assert res["meta"]["format_version"] == 1
        m = res["meta"]["tensors"][name]
        assert set(m) >= META_FIELDS, META_FIELDS - set(m)
        scheme = CASES[name]
        expect_shape = [16, 8, 3, 3] if name.startswith("conv.") else list(SHAPE)
        assert m["dtype"] == scheme["dtype"] and m["shape"] == expect_shape
        assert m["orig_dtype"] in ("F32", "float32")
        assert m["granularity"] == scheme["granularity"] and m["method"] == "rtn" and m["observer"] == "minmax"
        if "symmetric" in scheme:
            assert m["symmetric"] is scheme["symmetric"]
        if scheme["granularity"] == "group":
            assert m["group_size"] == scheme["group_size"]
        if scheme["granularity"] == "channel":
            assert m["axis"] == scheme.get("axis", 0)
        assert name not in res["tensors"], "a quantized tensor is stored as N.qdata, not under its own name"


def test_sync_and_job_artifacts_dequantize_alike(inputs: dict[str, np.ndarray], job_result: dict[str, Any],
                                                 sync_result: dict[str, Any]) -> None:
    for name in CASES:
        a, _ = dequantize(job_result["tensors"], name, job_result["meta"]["tensors"][name])
        b, _ = dequantize(sync_result["tensors"], name, sync_result["meta"]["tensors"][name])
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_pass_through_and_summary(model_file: bytes, sync_result: dict[str, Any]) -> None:
    src, _ = st_decode(model_file)
    for name in ("keep.bias", "keep.index"):
        got = sync_result["tensors"][name]
        assert (got.dtype, got.shape, got.raw) == (src[name].dtype, src[name].shape, src[name].raw)
        assert f"{name}.qdata" not in sync_result["tensors"]
    summary = sync_result["meta"]["summary"]
    assert set(summary) >= SUMMARY_FIELDS, SUMMARY_FIELDS - set(summary)
    assert summary["tensors_quantized"] == len(CASES) and summary["tensors_skipped"] == 2
    header = sync_result["summary"]
    assert header["tensors_quantized"] == len(CASES) and header["input_bytes"] == len(model_file)
