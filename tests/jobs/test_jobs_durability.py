"""A job accepted is never lost: a worker process killed with SIGKILL mid-job, then a fresh service."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from jobs_support import CONFIG, make_upload, wait_for
from safetensors.torch import load_file

from quantd.io.files import sha256_file
from quantd.jobs import JobService

MakeService = Callable[..., JobService]
HERE = Path(__file__).parent


async def test_sigkill_mid_job_then_restart_finishes_every_job(make_service: MakeService,
                                                              model_file: Path) -> None:
    api = make_service(workers=0)  # the API alone: the worker is the subprocess
    data_dir = api.config.data_dir
    ids = [(await api.submit(tenant="a", upload=make_upload(api, model_file), config=CONFIG)).id
           for _ in range(3)]
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_worker.py"), str(data_dir), "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        running = await asyncio.to_thread(
            wait_for, lambda: [r for r in map(api.store.get, ids) if r.status == "running"],
            timeout=60, what="the worker process to claim a job")
        assert len(running) == 1 and f"/{proc.pid}/" in running[0].lease_owner
        await asyncio.to_thread(wait_for, lambda: any(api.storage.tmp_root.glob("p-*/artifact-*.part")),
                                what="the partial artifact")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    killed = api.store.get(running[0].id)
    assert killed.status == "running"  # left mid-job, its 60 s lease still valid
    assert [api.store.get(i).status for i in ids].count("queued") == 2
    await api.stop()

    fresh = make_service(data_dir=data_dir)  # a restart: the dead owner is seen, its job re-queued

    def all_done() -> bool:
        return all(fresh.store.get(i).status in ("succeeded", "failed", "cancelled") for i in ids)

    await asyncio.to_thread(wait_for, all_done, timeout=60, what="every job to finish")
    jobs = [await fresh.get("a", i) for i in ids]
    assert [j.status for j in jobs] == ["succeeded"] * 3
    assert {j.id: j.attempts for j in jobs} == {i: 2 if i == killed.id else 1 for i in ids}
    for j in jobs:
        path, sha = await fresh.artifact_path("a", j.id)
        assert sha256_file(path) == sha
        assert set(load_file(str(path))) == {"layer.0.weight", "layer.1.weight", "layer.1.bias"}


async def test_expired_lease_requeued_by_the_periodic_reaper(make_service: MakeService,
                                                            model_file: Path) -> None:
    """An owner on another host cannot be checked: its job comes back when the lease expires."""
    api = make_service(workers=0)
    job = await api.submit(tenant="a", upload=make_upload(api, model_file), config=CONFIG)
    claimed = api.store.claim("elsewhere/1/x/w0", "cuda:0", 0.3)
    assert claimed is not None and claimed.id == job.id
    await asyncio.to_thread(wait_for, lambda: api.store.get(job.id).status == "queued",
                            what="the reaper to re-queue the job")
    worker = make_service(data_dir=api.config.data_dir)
    await asyncio.to_thread(wait_for, lambda: worker.store.get(job.id).status == "succeeded",
                            what="the job to finish")
    assert (await worker.get("a", job.id)).attempts == 2


async def test_sigkill_mid_directory_job_then_restart_finishes_it(make_service: MakeService, model_file: Path,
                                                                   tmp_path: Path) -> None:
    """A model directory job is stored as one tar, adopted like a one-file upload: a worker killed while it
    runs loses nothing; the restarted service finishes it with every output file listed."""
    import json
    import shutil
    import tarfile

    from quantd.io.model_dir import pack_tar
    from quantd.jobs.storage import StoredUpload

    api = make_service(workers=0)
    src = tmp_path / "dir"
    src.mkdir()
    shutil.copyfile(model_file, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "unknown-architecture"}))
    tar = api.new_upload_path(".tar")
    manifest = pack_tar([("config.json", src / "config.json"), ("model.safetensors", src / "model.safetensors")], tar)
    upload = StoredUpload(path=tar, filename="model", bytes=sum(f["bytes"] for f in manifest), sha256="0" * 64,
                          format="safetensors", tensors=3, files=tuple(manifest))
    job = await api.submit(tenant="a", upload=upload, config=CONFIG.model_copy(update={"output": "compressed-tensors"}))
    assert [f.path for f in job.input.files or []] == ["config.json", "model.safetensors"]
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_dir_worker.py"), str(api.config.data_dir), "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await asyncio.to_thread(wait_for, lambda: any(api.storage.tmp_root.glob("p-*/dirjob-*/out/partial.safetensors")),
                                timeout=60, what="the partial output")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()
    assert api.store.get(job.id).status == "running"
    await api.stop()

    fresh = make_service(data_dir=api.config.data_dir)
    await asyncio.to_thread(wait_for, lambda: fresh.store.get(job.id).status in ("succeeded", "failed"),
                            timeout=60, what="the job to finish")
    done = await fresh.get("a", job.id)
    assert done.status == "succeeded" and done.attempts == 2, done.error
    files = {f["path"]: f for f in await fresh.files("a", job.id)}
    assert set(files) == {"config.json", "model.safetensors"}
    path, sha = await fresh.artifact_path("a", job.id)
    assert sha256_file(path) == sha
    with tarfile.open(path) as t:
        assert sorted(t.getnames()) == ["config.json", "model.safetensors"]
    art, window = await fresh.output_file("a", job.id, "config.json")
    assert window is not None
    offset, size = window
    config = json.loads(b"".join(art.read(offset, size)))
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
