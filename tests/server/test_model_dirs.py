"""Model directories as jobs (CONTRACT §8): several ``file`` parts whose filenames are relative paths, checked
before the job is accepted; the output a directory listed by ``/files``, served file by file and as a tar."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

import pytest
import torch
from safetensors.torch import load, save

from .conftest import CONFIG, assert_problem, st_bytes

BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 100, "max_position_embeddings": 32}


def model_dir(seed: int = 0) -> dict[str, bytes]:
    """A two-shard model directory: weights split across shards, an index, config.json and other files."""
    g = torch.Generator().manual_seed(seed)
    a = {"encoder.layer.0.attention.self.query.weight": torch.randn(64, 64, generator=g),
         "encoder.layer.0.attention.self.query.bias": torch.randn(64, generator=g),
         "embeddings.word_embeddings.weight": torch.randn(100, 64, generator=g)}
    b = {"encoder.layer.0.intermediate.dense.weight": torch.randn(128, 64, generator=g),
         "encoder.layer.0.output.dense.weight": torch.randn(64, 128, generator=g)}
    index = {"metadata": {"total_size": 0}, "weight_map": {
        **dict.fromkeys(a, "model-00001-of-00002.safetensors"), **dict.fromkeys(b, "model-00002-of-00002.safetensors")}}
    return {"config.json": json.dumps(BERT).encode(), "model-00001-of-00002.safetensors": save(a),
            "model-00002-of-00002.safetensors": save(b), "model.safetensors.index.json": json.dumps(index).encode(),
            "tokenizer.json": b'{"version": "1.0"}', "extra/notes.txt": b"kept byte for byte\n"}


async def submit_dir(server: Any, files: dict[str, bytes] | list[tuple[str, bytes]], config: dict[str, Any] | None = None
                     ) -> Any:
    items = files.items() if isinstance(files, dict) else files
    parts = [("file", (path, data, "application/octet-stream")) for path, data in items]
    return await server.client.post("/v1/jobs", files=parts, data={"config": json.dumps(config or CONFIG)})


async def test_a_directory_job_keeps_the_sharding_and_serves_every_file(server):
    files = model_dir()
    r = await submit_dir(server, files)
    assert r.status_code == 202, r.text
    job = r.json()
    listed = {f["path"]: f for f in job["input"]["files"]}
    assert set(listed) == set(files)
    assert all(listed[p]["sha256"] == hashlib.sha256(d).hexdigest() and listed[p]["bytes"] == len(d)
               for p, d in files.items())
    assert job["input"]["tensors"] == 5
    done = await server.wait_job(job["id"])
    assert done["status"] == "succeeded", done.get("error")

    out = (await server.client.get(f"/v1/jobs/{job['id']}/files")).json()["files"]
    by_path = {f["path"]: f for f in out}
    assert set(by_path) == set(files)
    for path, f in by_path.items():
        r = await server.client.get(f"/v1/jobs/{job['id']}/files/{path}")
        assert r.status_code == 200 and r.headers["etag"] == f'"{f["sha256"]}"'
        assert hashlib.sha256(r.content).hexdigest() == f["sha256"] and len(r.content) == f["bytes"]
        if path not in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                        "model.safetensors.index.json"):
            assert r.content == files[path]  # copied byte for byte (no quantization_config in this format)
    part = await server.client.get(f"/v1/jobs/{job['id']}/files/tokenizer.json", headers={"Range": "bytes=2-8"})
    assert part.status_code == 206 and part.content == files["tokenizer.json"][2:9]
    assert part.headers["content-range"] == f"bytes 2-8/{len(files['tokenizer.json'])}"

    index = json.loads((await server.client.get(f"/v1/jobs/{job['id']}/files/model.safetensors.index.json")).content)
    shard2 = load((await server.client.get(f"/v1/jobs/{job['id']}/files/model-00002-of-00002.safetensors")).content)
    assert index["weight_map"]["encoder.layer.0.output.dense.weight.qdata"] == "model-00002-of-00002.safetensors"
    assert {n for n, s in index["weight_map"].items() if s == "model-00002-of-00002.safetensors"} == set(shard2)
    shards = [(await server.client.get(f"/v1/jobs/{job['id']}/files/model-0000{i}-of-00002.safetensors")).content
              for i in (1, 2)]
    # the tensors' bytes, as transformers counts them (each file less its 8-byte length and JSON header)
    assert index["metadata"]["total_size"] == sum(len(b) - 8 - int.from_bytes(b[:8], "little") for b in shards)

    report = (await server.client.get(f"/v1/jobs/{job['id']}/report")).json()
    assert {t["name"] for t in report["tensors"]} == {n for p, d in files.items() if p.endswith(".safetensors")
                                                      for n in load(d)}

    tar = await server.client.get(f"/v1/jobs/{job['id']}/artifact")
    assert tar.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}  # type: ignore[union-attr]
    assert {p: hashlib.sha256(d).hexdigest() for p, d in members.items()} == {p: f["sha256"] for p, f in by_path.items()}
    missing = await server.client.get(f"/v1/jobs/{job['id']}/files/nope.json")
    assert_problem(missing, 404)


async def test_compressed_tensors_directory_gets_quantization_config(server):
    config = {"output": "compressed-tensors", "scheme": {"dtype": "int4", "group_size": 32, "symmetric": True}}
    r = await submit_dir(server, model_dir(), config)
    assert r.status_code == 202, r.text
    done = await server.wait_job(r.json()["id"])
    assert done["status"] == "succeeded", done.get("error")
    cfg = json.loads((await server.client.get(f"/v1/jobs/{done['id']}/files/config.json")).content)
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and cfg["hidden_size"] == 64
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    report = (await server.client.get(f"/v1/jobs/{done['id']}/report")).json()
    skipped = {t["name"]: t["reason"] for t in report["tensors"] if t["skipped"]}
    assert skipped["embeddings.word_embeddings.weight"]  # left as it is, with the reason
    assert report["summary"]["tensors_quantized"] == 3


async def test_one_file_compressed_tensors_job_writes_a_directory(server):
    config = {"output": "compressed-tensors", "scheme": {"dtype": "int8", "granularity": "channel",
                                                        "symmetric": True}}
    r = await server.submit(st_bytes(), config=config)
    assert r.status_code == 202, r.text
    done = await server.wait_job(r.json()["id"])
    assert done["status"] == "succeeded", done.get("error")
    files = {f["path"] for f in (await server.client.get(f"/v1/jobs/{done['id']}/files")).json()["files"]}
    assert files == {"config.json", "model.safetensors"}
    shard = load((await server.client.get(f"/v1/jobs/{done['id']}/files/model.safetensors")).content)
    assert shard["layer.weight"].dtype == torch.int8 and shard["layer.weight_scale"].shape == (16, 1)


async def test_one_file_job_lists_its_artifact(server):
    r = await server.submit(st_bytes())
    done = await server.wait_job(r.json()["id"])
    (entry,) = (await server.client.get(f"/v1/jobs/{done['id']}/files")).json()["files"]
    assert entry["sha256"] == done["result"]["artifact_sha256"]
    whole = await server.client.get(f"/v1/jobs/{done['id']}/files/{entry['path']}")
    assert whole.status_code == 200 and hashlib.sha256(whole.content).hexdigest() == entry["sha256"]


def raw_multipart(files: list[tuple[str, bytes]], config: dict[str, Any]) -> tuple[bytes, str]:
    """A multipart body with the filenames exactly as given (an HTTP client would escape some characters)."""
    boundary = "quantd-test-boundary"
    out = [f'--{boundary}\r\nContent-Disposition: form-data; name="config"\r\n\r\n{json.dumps(config)}\r\n'.encode()]
    for path, data in files:
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path}"\r\n\r\n'
        out += [head.encode("utf-8"), data, b"\r\n"]
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("path", ["../escape.json", "/etc/passwd", "a\\b.json", "a/../../b.json", "a//b.json",
                                  "./config.json", "ctl\x01.json", "tab\t.json", "C:/x.json",
                                  # a multipart parser's old-browser workaround cut these to their last part
                                  "C:\\dir\\evil.json", "C:\\..\\..\\model.safetensors"])
async def test_hostile_paths_are_422_naming_the_path(server, path):
    body, ctype = raw_multipart([*model_dir().items(), (path, b"{}")], CONFIG)
    r = await server.client.post("/v1/jobs", content=body, headers={"content-type": ctype})
    problem = assert_problem(r, 422)
    assert repr(path) in problem["detail"] or path in problem["detail"], problem["detail"]
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_a_very_long_path_is_422_naming_the_rule(server):
    """A path past the parser's default header line (4 KiB) still reaches §8's check: 422, not a 400."""
    path = "d/" * 3000 + "x.json"
    body, ctype = raw_multipart([*model_dir().items(), (path, b"{}")], CONFIG)
    r = await server.client.post("/v1/jobs", content=body, headers={"content-type": ctype})
    assert "longer than 1024 characters" in assert_problem(r, 422)["detail"]


async def test_a_path_given_twice_is_422(server):
    files = [*model_dir().items(), ("tokenizer.json", b"{}")]
    body = assert_problem(await submit_dir(server, files), 422)
    assert "tokenizer.json" in body["detail"] and "twice" in body["detail"]


@pytest.mark.parametrize(("file", "under"), [("extra", "extra/notes.txt"), ("tokenizer.json", "tokenizer.json/x")])
async def test_a_path_that_is_also_a_folder_is_422(server, file, under):
    """A file and a folder of one name cannot both be written: refused before the job is accepted."""
    files = {**model_dir(), file: b"{}", under: b"{}"}
    body = assert_problem(await submit_dir(server, files), 422)
    assert repr(file) in body["detail"] and "folder" in body["detail"], body["detail"]
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_files_with_names_beyond_latin_1_are_served(server):
    """Header values are Latin-1: a file named ``说明.json`` (and a one-file job's artifact named after its
    upload) is served with an ASCII ``filename`` and RFC 6266's UTF-8 ``filename*``."""
    r = await submit_dir(server, {**model_dir(), "说明.json": b'{"k": 1}'})
    done = await server.wait_job(r.json()["id"])
    assert done["status"] == "succeeded", done.get("error")
    got = await server.client.get(f"/v1/jobs/{done['id']}/files/说明.json")
    assert got.status_code == 200 and got.content == b'{"k": 1}'
    assert got.headers["content-disposition"] == \
        "attachment; filename=\"__.json\"; filename*=UTF-8''%E8%AF%B4%E6%98%8E.json"
    r = await server.client.post("/v1/quantize", files={"file": ("模型.safetensors", st_bytes())},
                                 data={"config": json.dumps(CONFIG)})
    assert r.status_code == 200, r.text
    assert "filename*=UTF-8''%E6%A8%A1%E5%9E%8B.quantd.safetensors" in r.headers["content-disposition"]


def _with_index(files: dict[str, bytes], change: Any) -> dict[str, bytes]:
    index = json.loads(files["model.safetensors.index.json"])
    change(index["weight_map"])
    return {**files, "model.safetensors.index.json": json.dumps(index).encode()}


@pytest.mark.parametrize(("case", "needle"), [
    ("lying-index", "places tensor"),
    ("missing-shard", "not in the upload"),
    ("unnamed-shard", "is not named by"),
    ("tensor-in-two-shards", "in two shards"),
    ("tensor-not-in-index", "is not in model.safetensors.index.json"),
])
async def test_index_and_shards_must_agree(server, case, needle):
    files = model_dir()
    if case == "lying-index":
        files = _with_index(files, lambda m: m.update({"encoder.layer.0.output.dense.weight":
                                                       "model-00001-of-00002.safetensors"}))
    elif case == "missing-shard":
        del files["model-00002-of-00002.safetensors"]
    elif case == "unnamed-shard":
        files["model-00003-of-00002.safetensors"] = save({"x.weight": torch.zeros(4, 4)})
    elif case == "tensor-in-two-shards":
        files["model-00003-of-00002.safetensors"] = save({"encoder.layer.0.output.dense.weight": torch.zeros(4, 4)})
        files = _with_index(files, lambda m: None)
    else:
        files = _with_index(files, lambda m: m.pop("embeddings.word_embeddings.weight"))
    body = assert_problem(await submit_dir(server, files), 422)
    assert needle in body["detail"], body["detail"]


@pytest.mark.parametrize("metadata", [[1], "x", 3])
async def test_an_index_whose_metadata_is_not_an_object_is_422(server, metadata):
    files = model_dir()
    index = json.loads(files["model.safetensors.index.json"])
    files["model.safetensors.index.json"] = json.dumps({**index, "metadata": metadata}).encode()
    body = assert_problem(await submit_dir(server, files), 422)
    assert "model.safetensors.index.json" in body["detail"] and '"metadata"' in body["detail"], body["detail"]
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_an_index_whose_weight_map_is_not_names_to_files_is_422(server):
    files = _with_index(model_dir(), lambda m: m.update({"embeddings.word_embeddings.weight": 1}))
    body = assert_problem(await submit_dir(server, files), 422)
    assert "model.safetensors.index.json" in body["detail"] and '"weight_map"' in body["detail"], body["detail"]


async def test_a_path_component_longer_than_name_max_is_422(server):
    path = "d/" + "x" * 300 + ".json"
    body = assert_problem(await submit_dir(server, [*model_dir().items(), (path, b"{}")]), 422)
    assert "x" * 300 in body["detail"] and "255 bytes" in body["detail"], body["detail"][:200]
    assert str(server.settings.data_dir) not in body["detail"]
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_a_directory_over_the_size_limit_is_413(make_server):
    files = model_dir()
    total = sum(len(d) for d in files.values())
    async with make_server(max_upload_bytes=total - 1, max_sync_bytes=1024) as server:
        assert_problem(await submit_dir(server, files), 413)
        listed = (await server.client.get("/v1/jobs")).json()["items"]
        assert listed == []
        leftovers = [p for p in (server.settings.data_dir / "tmp").iterdir() if p.name.startswith("upload")]
        assert leftovers == []


async def test_sync_quantize_points_directory_formats_to_jobs(server):
    files = {"file": ("m.safetensors", st_bytes(), "application/octet-stream")}
    r = await server.client.post("/v1/quantize", files=files, data={"config": json.dumps({"output": "compressed-tensors"})})
    body = assert_problem(r, 422)
    assert "/v1/jobs" in body["detail"]
