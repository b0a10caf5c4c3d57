"""Model directories through the SDK against a real server: ``submit(dir)`` uploads every file in one body,
``download(out_dir)`` writes the output directory, each file sha256-checked, resuming what is there."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantd_client import QuantConfig, Scheme
from quantd_client._async import AsyncClient
from quantd_client._client import Client

pytestmark = pytest.mark.slow
CONFIG = QuantConfig(scheme=Scheme(dtype="int8", granularity="channel", symmetric=True))


def make_model_dir(root: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    root.mkdir()
    save_file({"a.weight": torch.randn(32, 64, generator=g)}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.randn(16, 64, generator=g), "b.bias": torch.randn(16, generator=g)},
              str(root / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return root


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_submit_a_directory_and_download_it_resuming(live_url: str, api_key: str, tmp_path: Path) -> None:
    src = make_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    with Client(live_url, api_key=api_key) as c:
        job = c.submit(src, CONFIG).wait(timeout=120)
        assert job.status == "succeeded", job.error
        assert {f.path for f in job.model.input.files or []} == {
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "tokenizer/vocab.txt"}
        job.download(out)
        files = {f.path: f for f in job.result.files or []}  # type: ignore[union-attr]
        assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == set(files)
        assert all(sha(out / p) == f.sha256 for p, f in files.items())
        assert (out / "tokenizer" / "vocab.txt").read_text() == "a\nb\n"
        assert len(job.report().tensors) == 3

        # Resume: one file gone, one cut short; the whole ones are kept as they are.
        kept = out / "model.safetensors.index.json"
        os.utime(kept, (1, 1))
        (out / "tokenizer" / "vocab.txt").unlink()
        shard = out / "model-00001-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[:100])
        job.download(out)
        assert all(sha(out / p) == f.sha256 for p, f in files.items())
        assert kept.stat().st_mtime == 1


def test_async_client_submits_and_downloads_a_directory(live_url: str, api_key: str, tmp_path: Path) -> None:
    src = make_model_dir(tmp_path / "model")

    async def main() -> None:
        async with AsyncClient(live_url, api_key=api_key) as c:
            job = await (await c.submit(src, CONFIG)).wait(timeout=120)
            assert job.status == "succeeded", job.error
            await job.download(tmp_path / "out")
            for f in job.result.files or []:  # type: ignore[union-attr]
                assert sha(tmp_path / "out" / f.path) == f.sha256

    asyncio.run(main())


def test_download_refuses_an_output_path_that_leaves_the_directory(tmp_path: Path) -> None:
    from quantd_client import Job
    from quantd_client._job import JobHandle
    from quantd_client._schemas import FileEntry

    job = Job.model_validate({
        "id": "j", "status": "succeeded", "created_at": "2026-01-01T00:00:00Z", "config": {},
        "input": {"filename": "model", "bytes": 1, "sha256": "x", "format": "safetensors", "tensors": 1},
        "result": {"artifact_bytes": 1, "artifact_sha256": "x", "files": [FileEntry(path="../evil", bytes=1,
                                                                                    sha256="x").model_dump()],
                   "summary": {"tensors_quantized": 0, "tensors_skipped": 0, "input_bytes": 1, "output_bytes": 1,
                               "compression_ratio": 1.0, "bits_per_weight": 32.0, "elapsed_s": 0.0, "mean_sqnr_db": None,
                               "min_sqnr_db": None, "worst_tensor": None,
                               "device": "cpu"}}})
    from quantd_client._exceptions import ValidationError

    with pytest.raises(ValidationError, match="evil"):
        JobHandle(None, job).download(tmp_path / "out")  # type: ignore[arg-type]
    assert not (tmp_path / "evil").exists()
