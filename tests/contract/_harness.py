"""Outside-in contract helpers: a real ``python -m quantd serve`` process, plain httpx, and a
safetensors codec written from the file format alone (struct + json + numpy; no safetensors lib,
no quantd). Nothing here imports quantd's internals or quantd_client: only the process launcher
:mod:`quantd.testing` (stdlib and httpx)."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from quantd.testing import free_port, quantd_env, spawn, stop, wait_ready

KEY_A = "contract-key-aaaa-0001"
KEY_B = "contract-key-bbbb-0002"
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path
    client: httpx.Client

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start_server(tmp: Path, env_extra: dict[str, str]) -> Server:
    """``quantd serve`` through :mod:`quantd.testing` (a process launcher: stdlib and httpx only), ready once
    /healthz answers; the tests talk to it over plain HTTP."""
    env = quantd_env({"QUANTD_DEVICE": "cpu", "QUANTD_WARMUP": "0", **env_extra})
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "server.log"
    proc = spawn("serve", tmp / "data", log, "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                 env=env)
    try:
        wait_ready(base, proc, log, path="/healthz", timeout_s=60.0)
    except AssertionError:
        stop(proc)
        raise
    return Server(base, proc, log, httpx.Client(base_url=base, timeout=120.0))


def stop_server(srv: Server) -> None:
    srv.client.close()
    stop(srv.proc, timeout_s=15.0)


# ---- safetensors, from the format description: u64 LE header length, JSON header, raw data ----

ST_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
    "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 → bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def st_encode(tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> bytes:
    """``{name: (ST dtype, array)}`` → safetensors bytes. BF16 arrays are given as float32."""
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, (dt, arr) in tensors.items():
        raw = (f32_to_bf16_bits(arr) if dt == "BF16" else np.ascontiguousarray(arr, ST_DTYPES[dt])).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + b"".join(chunks)


@dataclass
class StTensor:
    dtype: str
    shape: tuple[int, ...]
    raw: bytes

    def array(self) -> np.ndarray:
        a = np.frombuffer(self.raw, dtype=ST_DTYPES[self.dtype]).reshape(self.shape)
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "F8_E4M3":
            return decode_fp8(a, exp_bits=4, man_bits=3, bias=7, ieee_special=False)
        if self.dtype == "F8_E5M2":
            return decode_fp8(a, exp_bits=5, man_bits=2, bias=15, ieee_special=True)
        return a


def st_decode(data: bytes) -> tuple[dict[str, StTensor], dict[str, str]]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    out: dict[str, StTensor] = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        out[name] = StTensor(h["dtype"], tuple(h["shape"]), body[a:b])
    return out, meta


def decode_fp8(bits: np.ndarray, *, exp_bits: int, man_bits: int, bias: int, ieee_special: bool) -> np.ndarray:
    """OCP fp8: e4m3fn has no inf (S.1111.111 is NaN); e5m2 is IEEE-like (exponent all ones = inf/NaN)."""
    b = bits.astype(np.int64)
    sign = np.where(b >> 7 == 1, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = b & ((1 << man_bits) - 1)
    normal = (1.0 + m / 2**man_bits) * np.exp2(e.astype(np.float64) - bias)
    sub = (m / 2**man_bits) * 2.0 ** (1 - bias)
    val = sign * np.where(e == 0, sub, normal)
    emax = (1 << exp_bits) - 1
    if ieee_special:
        val = np.where(e == emax, np.where(m == 0, sign * np.inf, np.nan), val)
    else:
        val = np.where((e == emax) & (m == (1 << man_bits) - 1), np.nan, val)
    return val.astype(np.float32)


# Written from CONTRACT §5 (code domains) and QLoRA's NF4 table, not imported from the product.
INT_DOMAIN = {"int8": (8, -128, 127), "int4": (4, -8, 7), "int3": (3, -4, 3), "int2": (2, -2, 1),
              "uint8": (8, 0, 255), "uint4": (4, 0, 15)}
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])

# ---- the reader (CONTRACT §5) ----

def unpack_bits(raw: bytes, bits: int, numel: int) -> np.ndarray:
    """Code j occupies stream bits [j·b, j·b+b); stream bit i is bit i%8 of byte i//8."""
    stream = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[: numel * bits]
    return (stream.reshape(numel, bits).astype(np.int64) << np.arange(bits)).sum(axis=1)


def expand(param: np.ndarray, shape: tuple[int, ...], m: dict[str, Any]) -> np.ndarray:
    """Broadcast a per-tensor / per-channel / per-group parameter to the full tensor shape."""
    gran = m["granularity"]
    if gran == "tensor":
        assert param.shape == (), param.shape
        return np.broadcast_to(param, shape)
    axis = m["axis"] % len(shape)
    if gran == "channel":
        assert param.shape == (shape[axis],), (param.shape, shape, axis)
        return np.broadcast_to(param.reshape([-1 if i == axis else 1 for i in range(len(shape))]), shape)
    gs = m["group_size"]
    moved = (shape[axis], *[s for i, s in enumerate(shape) if i != axis])
    rows = shape[axis]
    cols = math.prod(shape) // rows
    assert param.shape == (rows, cols // gs), (param.shape, rows, cols, gs)
    full = np.repeat(param, gs, axis=1).reshape(moved)
    return np.moveaxis(full, 0, axis)


def dequantize(tensors: dict[str, StTensor], name: str, m: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """→ (x̂ as float64, parts: codes, scale, zero_point arrays as stored, for further checks)."""
    shape = tuple(m["shape"])
    numel = math.prod(shape)
    dt = m["dtype"]
    qd = tensors[f"{name}.qdata"]
    parts: dict[str, Any] = {"qdata": qd}
    if dt in ("float16", "bfloat16"):
        assert qd.dtype == {"float16": "F16", "bfloat16": "BF16"}[dt]
        return qd.array().astype(np.float64).reshape(shape), parts
    scale = tensors[f"{name}.scale"].array().astype(np.float64)
    parts["scale"] = scale
    full_scale = expand(scale, shape, m)
    if dt.startswith("fp8"):
        assert qd.dtype == {"fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2"}[dt]
        assert f"{name}.zero_point" not in tensors
        return qd.array().astype(np.float64).reshape(shape) * full_scale, parts
    if dt == "nf4":
        assert qd.dtype == "U8" and len(qd.raw) == math.ceil(numel * 4 / 8)
        idx = unpack_bits(qd.raw, 4, numel).reshape(shape)
        parts["codes"] = idx
        return NF4[idx] * full_scale, parts
    bits, qmin, qmax = INT_DOMAIN[dt]
    if bits < 8:
        assert qd.dtype == "U8" and qd.shape == (math.ceil(numel * bits / 8),), (qd.dtype, qd.shape)
        codes = unpack_bits(qd.raw, bits, numel).reshape(shape) + qmin
    else:
        assert qd.dtype == {"int8": "I8", "uint8": "U8"}[dt] and qd.shape == shape, (qd.dtype, qd.shape)
        codes = qd.array().astype(np.int64)
    assert codes.min() >= qmin and codes.max() <= qmax
    parts["codes"] = codes
    zp_name = f"{name}.zero_point"
    if m["symmetric"]:
        assert zp_name not in tensors, "symmetric tensors carry no zero point"
        zp = np.zeros(shape)
    else:
        zpa = tensors[zp_name].array().astype(np.int64)
        assert zpa.shape == scale.shape, (zpa.shape, scale.shape)
        assert zpa.min() >= qmin and zpa.max() <= qmax, "zero_point is in the code domain"
        parts["zero_point"] = tensors[zp_name]
        zp = expand(zpa, shape, m)
    return (codes - zp) * full_scale, parts



# ---- HTTP helpers ----

def wait_job(client: httpx.Client, job_id: str, *, timeout: float = 120.0,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert r.status_code == 200, r.text
        job: dict[str, Any] = r.json()
        if job["status"] in TERMINAL:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")
        time.sleep(0.05)  # poll step under a deadline


def assert_problem(r: httpx.Response, status: int | tuple[int, ...]) -> dict[str, Any]:
    wanted = (status,) if isinstance(status, int) else status
    assert r.status_code in wanted, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers.get("content-type")
    body: dict[str, Any] = r.json()
    assert body["status"] == r.status_code
    for field in ("type", "title", "detail"):
        assert isinstance(body.get(field), str) and body[field], (field, body)
    assert "Traceback" not in r.text
    return body
