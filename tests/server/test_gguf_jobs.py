"""GGUF over HTTP and from the command line: a job turns a GGUF model into llama.cpp's Q8_0 (the bytes
the in-process run writes), takes an importance matrix as its calibration part, refuses a hostile GGUF."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from _gguf_models import llama_cpp_or_none, llama_logits, write_tiny_llama
from quantd.cli import main
from quantd.io.gguf_file import GGUFFile
from quantd.io.pipeline import quantize_file
from quantd_client import QuantConfig

from .conftest import assert_problem, pt_bytes, st_bytes

CONFIG = {"output": "gguf", "gguf_mix": "Q8_0"}


async def test_gguf_job_over_http(server, tmp_path: Path) -> None:
    src = write_tiny_llama(tmp_path / "tiny.gguf")
    data = src.read_bytes()
    r = await server.submit(data, config=CONFIG, filename="tiny.gguf")
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["input"]["format"] == "gguf" and job["input"]["tensors"] == 39
    done = await server.wait_job(job["id"], timeout=300)
    assert done["status"] == "succeeded", done
    resp = await server.client.get(f"/v1/jobs/{job['id']}/artifact")
    assert f'filename="{job["id"]}.gguf"' in resp.headers["content-disposition"]
    art = resp.content
    listed = (await server.client.get(f"/v1/jobs/{job['id']}/files")).json()["files"]
    assert [f["path"] for f in listed] == ["tiny.gguf"]  # the input's stem and the format's suffix
    assert (await server.client.get(f"/v1/jobs/{job['id']}/files/tiny.gguf")).content == art
    out = tmp_path / "job.gguf"
    out.write_bytes(art)
    local = tmp_path / "local.gguf"
    quantize_file(src, local, QuantConfig.model_validate(CONFIG), device="cpu")
    assert art == local.read_bytes()  # Q8_0 is ggml's reference quantizer: one byte stream
    rep = (await server.client.get(f"/v1/jobs/{job['id']}/report")).json()
    q = {t["name"]: t for t in rep["tensors"]}["blk.0.ffn_up.weight"]
    assert q["scheme"]["dtype"] == "q8_0" and q["stats"]["sqnr_db"] > 40
    if llama_cpp_or_none() is not None:  # llama.cpp runs the job's file, close to the F32 model
        import numpy as np

        ref, got = llama_logits(src), llama_logits(out)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


async def test_gguf_job_with_an_importance_matrix(server, tmp_path: Path) -> None:
    src = write_tiny_llama(tmp_path / "tiny.gguf")
    dat = bytearray(struct.pack("<i", 1))
    name = b"blk.1.ffn_up.weight"
    dat += struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, 256) + (b"\x00\x00\x80\x3f" * 256)
    dat += struct.pack("<ii", 1, 0)
    files = {"file": ("tiny.gguf", src.read_bytes(), "application/octet-stream"),
             "calibration": ("imatrix.dat", bytes(dat), "application/octet-stream")}
    cfg = {"output": "gguf", "gguf_mix": "Q4_K_M"}
    r = await server.client.post("/v1/jobs", files=files, data={"config": json.dumps(cfg)})
    assert r.status_code == 202, r.text
    done = await server.wait_job(r.json()["id"], timeout=300)
    assert done["status"] == "succeeded", done
    files["calibration"] = ("imatrix.dat", b"\x01\x00\x00\x00junk", "application/octet-stream")
    r = await server.client.post("/v1/jobs", files=files, data={"config": json.dumps(cfg)})
    assert "calibration" in assert_problem(r, 422)["detail"]
    # an entry whose length is not the tensor's rows: refused before the job is accepted, naming the tensor
    short = dat.replace(struct.pack("<ii", 1, 256) + (b"\x00\x00\x80\x3f" * 256),
                        struct.pack("<ii", 1, 128) + (b"\x00\x00\x80\x3f" * 128))
    files["calibration"] = ("imatrix.dat", bytes(short), "application/octet-stream")
    r = await server.client.post("/v1/jobs", files=files, data={"config": json.dumps(cfg)})
    problem = assert_problem(r, 422)
    assert "calibration" in problem["detail"] and "blk.1.ffn_up.weight" in problem["detail"], problem
    assert any("calibration" in str(e["loc"]) for e in problem["errors"]), problem
    # another model's matrix: it names none of this model's tensors and would change nothing
    other = dat.replace(name, b"blk.7.ffn_xx.weight")
    files["calibration"] = ("imatrix.dat", bytes(other), "application/octet-stream")
    r = await server.client.post("/v1/jobs", files=files, data={"config": json.dumps(cfg)})
    assert "no entry for any tensor" in assert_problem(r, 422)["detail"]
    assert len((await server.client.get("/v1/jobs")).json()["items"]) == 1  # the first job only


async def test_hostile_gguf_upload_is_a_422(server) -> None:
    data = b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0)
    r = await server.submit(data, config=CONFIG, filename="evil.gguf")
    assert "tensors" in assert_problem(r, 422)["detail"]


def test_cli_quantizes_gguf_in_process(tmp_path: Path) -> None:
    src = write_tiny_llama(tmp_path / "tiny.gguf")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"output": "gguf", "gguf_mix": "Q4_K_M"}))
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(src), "-o", str(out), "--config", str(cfg), "--device", "cpu"]) == 0
    f = GGUFFile(out)
    assert f.get("general.file_type") == 15 and len(f.tensors) == 39
    dat = tmp_path / "imatrix.dat"
    name = b"blk.0.ffn_up.weight"
    dat.write_bytes(struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 1, 256) + b"\x00\x00\x80\x3f" * 256
                    + struct.pack("<ii", 1, 0))
    out2 = tmp_path / "out2.gguf"
    assert main(["quantize", str(src), "-o", str(out2), "--gguf-mix", "Q6_K", "--calibration", str(dat),
                 "--device", "cpu"]) == 0
    assert GGUFFile(out2).get("general.file_type") == 18


@pytest.mark.parametrize("config", [CONFIG, {"output": "gguf", "scheme": {"dtype": "q8_0"}}])
@pytest.mark.parametrize("kind", ["safetensors", "pytorch"])
async def test_a_gguf_job_from_a_non_gguf_file_is_422_before_it_is_accepted(server, config, kind) -> None:
    """As POST /v1/quantize answers: output "gguf" needs a GGUF input (field output)."""
    data = st_bytes() if kind == "safetensors" else pt_bytes({"layer.weight": torch.randn(16, 64)})
    filename = "m.safetensors" if kind == "safetensors" else "m.pt"
    body = assert_problem(await server.submit(data, config=config, filename=filename), 422)
    assert "needs a GGUF input" in body["detail"] and "output" in body["detail"], body["detail"]
    sync = await server.client.post("/v1/quantize", files={"file": (filename, data)},
                                    data={"config": json.dumps(config)})
    assert assert_problem(sync, 422)["detail"] == body["detail"]  # the same check, the same answer
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_a_gguf_job_from_a_model_directory_is_422_before_it_is_accepted(server) -> None:
    from .test_model_dirs import model_dir, submit_dir

    body = assert_problem(await submit_dir(server, model_dir(), CONFIG), 422)
    assert "needs a GGUF input" in body["detail"], body["detail"]
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_an_already_quantized_gguf_is_a_422_and_a_sync_gguf_result_is_named_gguf(server, tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for config in (CONFIG, {"scheme": {"dtype": "int8"}}):
        r = await server.submit(path.read_bytes(), config=config, filename="q8.gguf")
        assert "already quantized (Q8_0)" in assert_problem(r, 422)["detail"]
    r = await server.client.post("/v1/quantize", files={"file": ("q8.gguf", path.read_bytes())},
                                 data={"config": json.dumps(CONFIG)})
    assert "already quantized" in assert_problem(r, 422)["detail"]
    src = write_tiny_llama(tmp_path / "tiny.gguf")
    r = await server.client.post("/v1/quantize", files={"file": ("tiny.gguf", src.read_bytes())},
                                 data={"config": json.dumps(CONFIG)})
    assert r.status_code == 200 and r.content[:4] == b"GGUF"
    assert 'filename="tiny.gguf"' in r.headers["content-disposition"]  # the format's suffix, not .quantd.safetensors
