"""JobService end to end with embedded workers and the real pipeline on a small safetensors file."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs_support import CONFIG, GatedPipeline, cast_pipeline, make_upload, wait_for
from safetensors.torch import load_file

from quantd.errors import JobCancelled, MalformedInputError
from quantd.io.files import sha256_file
from quantd.jobs import (
    IdempotencyConflict,
    InvalidListQuery,
    JobExpired,
    JobNotFound,
    JobNotReady,
    JobService,
    QueueFull,
)
from quantd_client import Job, QuantConfig, Report, Scheme

MakeService = Callable[..., JobService]


async def finished(svc: JobService, tenant: str, job_id: str, timeout: float = 30.0) -> Job:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        job = await svc.get(tenant, job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            return job
        if loop.time() > deadline:
            raise AssertionError(f"job {job_id} still {job.status} after {timeout}s")
        await asyncio.sleep(0.01)


async def test_submit_runs_to_success(make_service: MakeService, model_file: Path) -> None:
    svc = make_service()
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    assert job.status == "queued" and job.input.tensors == 3 and job.input.filename == "model.safetensors"
    done = await finished(svc, "a", job.id)
    assert done.status == "succeeded", done.error
    assert done.attempts == 1 and done.device == "cpu" and done.started_at and done.finished_at
    assert done.progress.tensors_done == done.progress.tensors_total == 3
    path, sha = await svc.artifact_path("a", job.id)
    assert sha == sha256_file(path) == done.result.artifact_sha256
    assert done.result.artifact_bytes == path.stat().st_size
    report = await svc.report("a", job.id)
    assert report.job_id == job.id and [t.name for t in report.tensors] == ["layer.0.weight", "layer.1.bias",
                                                                            "layer.1.weight"]
    assert report.summary == done.result.summary
    expected = {k: v.to(torch.float16) for k, v in load_file(str(model_file)).items()}
    got = load_file(str(path))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


async def test_real_pipeline(make_service: MakeService, model_file: Path) -> None:
    """With quantd.io.quantize_file and the engine: an int4 artifact that dequantizes close to the input."""
    from quantd.io import dequantize_artifact, quantize_file

    svc = make_service(quantize_fn=quantize_file)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    done = await finished(svc, "a", job.id)
    assert done.status == "succeeded", done.error
    path, _ = await svc.artifact_path("a", job.id)
    x = load_file(str(model_file))["layer.0.weight"]
    x_hat = dequantize_artifact(path)["layer.0.weight"]
    assert x_hat.shape == x.shape
    assert 0 < (x - x_hat).abs().max() < x.abs().max() / 4
    assert done.result.summary.tensors_quantized == 2


async def test_job_persisted_before_submit_returns(make_service: MakeService, model_file: Path) -> None:
    """With no workers the job stays queued, and a second service on the same dir sees it."""
    api = make_service(workers=0)
    job = await api.submit(tenant="a", upload=make_upload(api, model_file), config=CONFIG)
    other = make_service(workers=0, data_dir=api.config.data_dir)
    assert (await other.get("a", job.id)).status == "queued"
    assert api.queue_depth() == 1 and api.counts_by_status()["queued"] == 1


async def test_report_and_artifact_not_ready(make_service: MakeService, model_file: Path) -> None:
    svc = make_service(workers=0)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    with pytest.raises(JobNotReady) as e:
        await svc.report("a", job.id)
    assert type(e.value) is JobNotReady and "queued" in e.value.detail
    with pytest.raises(JobNotReady):
        await svc.artifact_path("a", job.id)


async def test_idempotency(make_service: MakeService, model_file: Path, tmp_path: Path) -> None:
    svc = make_service(workers=0)
    first = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG, idempotency_key="k1")
    second_upload = make_upload(svc, model_file)
    again = await svc.submit(tenant="a", upload=second_upload, config=CONFIG, idempotency_key="k1")
    assert again.id == first.id and svc.counts_by_status()["queued"] == 1
    assert not second_upload.path.exists()  # the duplicate upload is not kept
    other = await svc.submit(tenant="b", upload=make_upload(svc, model_file), config=CONFIG, idempotency_key="k1")
    assert other.id != first.id
    with pytest.raises(IdempotencyConflict):
        await svc.submit(tenant="a", upload=make_upload(svc, model_file),
                         config=QuantConfig(scheme=Scheme(dtype="int8")), idempotency_key="k1")


async def test_queue_full(make_service: MakeService, model_file: Path) -> None:
    svc = make_service(workers=0, max_queue=2, queue_full_retry_after_s=3)
    for _ in range(2):
        await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    upload = make_upload(svc, model_file)
    with pytest.raises(QueueFull) as e:
        await svc.submit(tenant="a", upload=upload, config=CONFIG)
    assert type(e.value) is QueueFull and e.value.retry_after == 3
    assert not upload.path.exists()
    assert svc.queue_depth() == 2


async def test_cancel_queued_deletes_files(make_service: MakeService, model_file: Path) -> None:
    svc = make_service(workers=0)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    upload = svc.storage.upload_path(job.id, "input")
    assert upload.is_file()
    cancelled = await svc.cancel("a", job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    assert not upload.exists()
    assert svc.queue_depth() == 0


async def test_cancel_running(make_service: MakeService, model_file: Path) -> None:
    gate = GatedPipeline()
    svc = make_service(quantize_fn=gate)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    await asyncio.to_thread(wait_for, gate.started.is_set, what="the pipeline to start")
    asked = await svc.cancel("a", job.id)
    assert asked.status == "cancelled"  # the worker saw the request within cancel_wait_s
    done = await finished(svc, "a", job.id)
    assert done.status == "cancelled"
    assert not svc.storage.upload_path(job.id, "input").exists()
    assert not svc.storage.artifact_path(job.id).exists()
    assert not any(svc.storage.tmp.iterdir())  # no partial artifact left behind


async def test_cancel_of_a_job_stuck_in_a_tensor_returns_it_running(make_service: MakeService,
                                                                     model_file: Path) -> None:
    """A running job whose worker does not look at the request within ``cancel_wait_s`` comes back
    ``running``, its cancel asked: DELETE does not hang on it."""
    started, release = threading.Event(), threading.Event()

    def stuck(*args: Any, **kwargs: Any) -> Report:
        started.set()
        release.wait(10)
        raise JobCancelled("let go")

    svc = make_service(quantize_fn=stuck, cancel_wait_s=0.3)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    await asyncio.to_thread(wait_for, started.is_set, what="the pipeline to start")
    asked = await svc.cancel("a", job.id)
    assert asked.status == "running"
    release.set()
    assert (await finished(svc, "a", job.id)).status == "cancelled"


async def test_events_progress_then_terminal(make_service: MakeService, model_file: Path) -> None:
    gate = GatedPipeline()
    svc = make_service(quantize_fn=gate)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    events: list[tuple[str, dict[str, Any]]] = []
    async for name, data in svc.events("a", job.id):
        events.append((name, data))
        if name == "progress" and data["tensors_total"] == 3:
            gate.release.set()
    names = [n for n, _ in events]
    assert names[-1] == "succeeded" and set(names[:-1]) == {"progress"}
    assert events[-1][1]["id"] == job.id and events[-1][1]["status"] == "succeeded"
    progress = [d for n, d in events if n == "progress"]
    assert all(a != b for a, b in itertools.pairwise(progress))  # only on change
    assert [p["tensors_done"] for p in progress] == sorted(p["tensors_done"] for p in progress)


async def test_local_workers_wake_event_streams_without_polling(make_service: MakeService,
                                                                 model_file: Path) -> None:
    svc = make_service(events_poll_s=30.0)  # a poll would take 30 s: only the workers' signals can be seen
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    t0 = time.monotonic()
    names = [name async for name, _ in svc.events("a", job.id)]
    assert names[-1] == "succeeded"
    assert time.monotonic() - t0 < 10.0


async def test_job_signals_wake_from_another_thread_and_time_out() -> None:
    from quantd.jobs.signals import JobSignals

    signals = JobSignals()
    assert await signals.wait("j", 0.01) is False
    timer = threading.Timer(0.05, signals.notify, args=("j",))
    timer.start()
    t0 = time.monotonic()
    assert await signals.wait("j", 30.0) is True
    assert time.monotonic() - t0 < 10.0
    signals.notify("nobody-waits")  # a no-op
    assert not signals._waiters  # waiters are dropped once woken or timed out


async def test_tenant_isolation(make_service: MakeService, model_file: Path) -> None:
    svc = make_service()
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    assert (await finished(svc, "a", job.id)).status == "succeeded"
    for call in (svc.get("b", job.id), svc.report("b", job.id), svc.artifact_path("b", job.id),
                 svc.cancel("b", job.id)):
        with pytest.raises(JobNotFound) as e:
            await call
        assert type(e.value) is JobNotFound
    with pytest.raises(JobNotFound):
        await anext(svc.events("b", job.id))
    assert (await svc.list("b")).items == []
    assert (await svc.get("a", job.id)).status == "succeeded"  # b's cancel did nothing
    for bad in ("../../etc/passwd", "", "A" * 32, job.id + "0"):
        with pytest.raises(JobNotFound):
            await svc.get("a", bad)


async def test_pagination(make_service: MakeService, model_file: Path) -> None:
    svc = make_service(workers=0)
    ids = [(await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)).id
           for _ in range(7)]
    await svc.submit(tenant="b", upload=make_upload(svc, model_file), config=CONFIG)
    await svc.cancel("a", ids[0])
    pages, cursor = [], None
    while True:
        page = await svc.list("a", limit=3, cursor=cursor)
        pages.append([j.id for j in page.items])
        cursor = page.next_cursor
        if cursor is None:
            break
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in p] == ids[::-1]  # newest first, no gaps, no repeats
    queued = await svc.list("a", status="queued", limit=100)
    assert [j.id for j in queued.items] == ids[:0:-1] and queued.next_cursor is None
    assert [j.id for j in (await svc.list("a", status="cancelled")).items] == [ids[0]]
    for kwargs in ({"limit": 0}, {"limit": 101}, {"status": "done"}, {"cursor": "not-a-cursor"},
                   {"cursor": "W10"}):
        with pytest.raises(InvalidListQuery):
            await svc.list("a", **kwargs)


async def test_twenty_concurrent_submissions(make_service: MakeService, model_file: Path) -> None:
    svc = make_service(workers=2)
    uploads = [make_upload(svc, model_file) for _ in range(20)]
    jobs = await asyncio.gather(*(svc.submit(tenant="a", upload=u, config=CONFIG) for u in uploads))
    assert len({j.id for j in jobs}) == 20
    done = await asyncio.gather(*(finished(svc, "a", j.id, timeout=60) for j in jobs))
    assert [j.status for j in done] == ["succeeded"] * 20
    assert all(j.attempts == 1 for j in done)
    assert svc.counts_by_status()["succeeded"] == 20 and svc.queue_depth() == 0


def raising(exc: BaseException) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fn


@pytest.mark.parametrize(("exc", "type_", "title"), [
    (MalformedInputError("tensor 'w' truncated"), "urn:quantd:malformed-input", "Malformed input"),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "urn:quantd:out-of-memory",
     "Out of device memory"),
    (ZeroDivisionError("boom"), "urn:quantd:internal", "Internal error"),
])
async def test_crash_policy(make_service: MakeService, model_file: Path, exc: BaseException, type_: str,
                            title: str, caplog: pytest.LogCaptureFixture) -> None:
    """Each failure ends the job failed, once (no retry), with its own error; the worker lives on."""
    svc = make_service(quantize_fn=raising(exc))
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    done = await finished(svc, "a", job.id)
    assert done.status == "failed" and done.attempts == 1
    assert (done.error.type, done.error.title) == (type_, title)
    assert str(exc).split(".")[0] in done.error.detail
    assert svc.live_workers() == 1


async def test_an_internal_error_never_shows_a_server_path(make_service: MakeService, model_file: Path) -> None:
    """An OSError (or any exception) naming a file under the data dir fails the job without that path."""
    import errno

    calls: list[str] = []

    def fails(src: Path, dst: Path, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["job_id"])
        if len(calls) == 1:
            raise OSError(errno.ENAMETOOLONG, "File name too long", str(dst.parent / ("x" * 300)))
        raise RuntimeError(f"could not read {src}: gone")

    svc = make_service(quantize_fn=fails)
    jobs = [await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG) for _ in range(2)]
    data_dir = str(svc.config.data_dir)
    details = []
    for job in jobs:
        done = await finished(svc, "a", job.id)
        assert done.status == "failed" and done.error.type == "urn:quantd:internal"
        details.append(done.error.detail)
    text = " ".join(details)
    assert "File name too long" in text and "could not read" in text, details
    assert data_dir not in text and str(Path(data_dir).resolve()) not in text and "x" * 300 not in text, details


async def test_a_result_the_storage_refuses_fails_the_job_saying_so(make_service: MakeService, model_file: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or full artifacts folder: the job fails at once with the cause, not after three lease
    expiries as a lost worker, and without the server's path."""
    import errno

    svc = make_service()
    storage = svc._storage

    def read_only(tmp: Path, job_id: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(tmp))

    monkeypatch.setattr(storage, "install_artifact", read_only)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    done = await finished(svc, "a", job.id)
    assert done.status == "failed" and done.attempts == 1, done
    assert done.error.type == "urn:quantd:storage-error" and "Read-only file system" in done.error.detail
    assert str(svc.config.data_dir) not in done.error.detail


async def test_a_report_that_cannot_be_written_fails_the_job_once(make_service: MakeService,
                                                                 model_file: Path) -> None:
    """Not a lost worker three times over: re-running would give the same report."""
    def unwritable(*args: Any, **kwargs: Any) -> Any:
        report = cast_pipeline(*args, **kwargs)
        report.tensors[0].name = "w\ud800"  # what the readers now refuse at the door
        return report

    svc = make_service(quantize_fn=unwritable)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    done = await finished(svc, "a", job.id)
    assert done.status == "failed" and done.attempts == 1, done
    assert done.error.type == "urn:quantd:internal" and "report cannot be written" in done.error.detail


async def test_worker_survives_a_crash(make_service: MakeService, model_file: Path) -> None:
    calls: list[str] = []

    def first_crashes(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["job_id"])
        if len(calls) == 1:
            raise RuntimeError("first job crashes")
        return cast_pipeline(*args, **kwargs)

    svc = make_service(quantize_fn=first_crashes)
    a = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    b = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    assert (await finished(svc, "a", a.id)).status == "failed"
    assert (await finished(svc, "a", b.id)).status == "succeeded"


async def test_ttl_sweep_deletes_files_keeps_row(make_service: MakeService, model_file: Path) -> None:
    svc = make_service(ttl_s=0.2)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    assert (await finished(svc, "a", job.id)).status == "succeeded"
    files = [svc.storage.upload_path(job.id, "input"), svc.storage.artifact_path(job.id),
             svc.storage.reports / f"{job.id}.json"]

    def expired() -> bool:
        return not any(f.exists() for f in files) and svc.store.get(job.id).expired_at is not None

    await asyncio.to_thread(wait_for, expired, what="the TTL sweep")
    assert (await svc.get("a", job.id)).status == "succeeded"
    with pytest.raises(JobExpired) as e:
        await svc.report("a", job.id)
    assert type(e.value) is JobExpired
    with pytest.raises(JobExpired):
        await svc.artifact_path("a", job.id)


async def test_delete_finished_job_deletes_files(make_service: MakeService, model_file: Path) -> None:
    svc = make_service()
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    assert (await finished(svc, "a", job.id)).status == "succeeded"
    assert (await svc.cancel("a", job.id)).status == "succeeded"
    assert not svc.storage.artifact_path(job.id).exists()
    with pytest.raises(JobExpired):
        await svc.artifact_path("a", job.id)


async def test_graceful_stop_gives_the_job_back(make_service: MakeService, model_file: Path) -> None:
    gate = GatedPipeline()
    svc = make_service(quantize_fn=gate)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    await asyncio.to_thread(wait_for, gate.started.is_set, what="the pipeline to start")
    data_dir = svc.config.data_dir
    await svc.stop()
    again = make_service(data_dir=data_dir)
    done = await finished(again, "a", job.id)
    assert done.status == "succeeded" and done.attempts == 1


async def test_ready(make_service: MakeService) -> None:
    svc = make_service()
    assert svc.ready() == {"database": True, "storage": True, "workers": 1}
    api_only = make_service(workers=0, data_dir=svc.config.data_dir)
    assert api_only.ready()["workers"] == 1  # the other service's worker, seen through the DB
    await svc.stop()
    assert api_only.ready()["workers"] == 0


async def test_a_worker_that_lost_its_lease_leaves_the_finished_job_alone(make_service: MakeService,
                                                                          model_file: Path) -> None:
    """A worker stalled past its lease (a paused VM, swap) while another finished the job must not
    replace that job's artifact and report when it comes back: the served file would no longer match
    the job's ETag/sha256."""
    started, release = threading.Event(), threading.Event()

    def stalled(src: Path, dst: Path, config: QuantConfig, **kwargs: Any) -> Report:
        report = cast_pipeline(src, dst, config, device="cpu")
        started.set()
        release.wait(10)  # ignores its lost lease, as a stopped process would
        return report

    svc = make_service(quantize_fn=stalled)
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    await asyncio.to_thread(wait_for, started.is_set, what="the pipeline to start")
    # What the reaper and a second worker do meanwhile: take the job over and finish it.
    with svc.store._tx() as db:  # type: ignore[attr-defined]
        db.execute("UPDATE jobs SET lease_owner = 'B#2', attempts = 2 WHERE id = ?", (job.id,))
    tmp = svc.storage.artifact_tmp_path(job.id)
    tmp.write_bytes(b"B's artifact")
    theirs = svc.storage.commit_artifact(tmp, job.id)
    svc.storage.put_report(job.id, '{"by": "B"}')
    summary = {"tensors_quantized": 0, "tensors_skipped": 0, "input_bytes": 0, "output_bytes": 0,
               "compression_ratio": 1.0, "bits_per_weight": 0.0, "mean_sqnr_db": None, "min_sqnr_db": None,
               "worst_tensor": None, "elapsed_s": 0.0, "device": "cpu"}
    assert svc.store.complete(job.id, "B#2", {"artifact_bytes": theirs.bytes, "artifact_sha256": theirs.sha256,
                                              "summary": summary})
    release.set()
    # Its artifact and report drafts go after its completion was refused: an empty tmp dir is its end.
    await asyncio.to_thread(wait_for, lambda: not any(svc.storage.tmp.iterdir()), what="the stalled worker to end")
    done = await svc.get("a", job.id)
    assert done.status == "succeeded" and done.result is not None
    assert done.result.artifact_sha256 == theirs.sha256
    assert sha256_file(svc.storage.artifact_path(job.id)) == theirs.sha256
    assert svc.storage.get_report(job.id) == '{"by": "B"}'


async def test_a_killed_worker_process_stops_counting_as_live_at_once(make_service: MakeService) -> None:
    """A worker process killed with SIGKILL never unregisters; its fresh heartbeat row made /readyz and
    /metrics count it live (and busy) for up to lease_s. Its process is gone, so it no longer counts."""
    import subprocess
    import sys

    from quantd.jobs.worker import BOOT, HOST

    svc = make_service(workers=0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    svc.store.register_worker(f"{HOST}/{gone.pid}/{BOOT}/w0", "cpu")
    svc.store.worker_heartbeat(f"{HOST}/{gone.pid}/{BOOT}/w0", "some-job")
    alive = f"{HOST}/{os.getppid()}/{BOOT}/w0"  # a process that is running (our parent)
    svc.store.register_worker(alive, "cpu")
    svc.store.worker_heartbeat(alive, "other-job")
    assert svc.live_workers() == 1 and svc.busy_workers() == 1


def test_a_gone_pid_is_dead_only_in_our_own_pid_namespace() -> None:
    """An owner whose pid is not running is dead only when it is of this host and PID namespace: a container
    sharing our hostname (``network_mode: host``) has pids of its own, and its live worker's pid may be free here."""
    import socket
    import subprocess
    import sys

    from quantd.jobs.worker import BOOT, HOST, owner_is_dead

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert owner_is_dead(f"{HOST}/{gone.pid}/{BOOT}/w0#1")
    assert not owner_is_dead(f"{HOST}/{os.getppid()}/{BOOT}/w0#1")
    if sys.platform.startswith("linux"):
        assert f"{socket.gethostname()}@{os.stat('/proc/self/ns/pid').st_ino}" == HOST
        other_namespace = f"{socket.gethostname()}@{os.stat('/proc/self/ns/pid').st_ino + 1}"
        assert not owner_is_dead(f"{other_namespace}/{gone.pid}/{BOOT}/w0#1")
        assert not owner_is_dead(f"{socket.gethostname()}/{gone.pid}/{BOOT}/w0#1")  # no namespace: not ours


async def test_close_streams_ends_the_event_streams_of_running_jobs(make_service: MakeService,
                                                                   model_file: Path) -> None:
    """A stopping server ends its event streams at once (uvicorn waits for open connections before it
    stops: one stream held a graceful stop for its whole 30 s timeout, then was cut mid-chunk)."""
    gate = GatedPipeline()
    svc = make_service(quantize_fn=gate, events_poll_s=30.0)  # only a signal can end the wait early
    job = await svc.submit(tenant="a", upload=make_upload(svc, model_file), config=CONFIG)
    await asyncio.to_thread(wait_for, gate.started.is_set, what="the pipeline to start")
    names: list[str] = []

    async def follow() -> None:
        async for name, _ in svc.events("a", job.id):
            names.append(name)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    svc.close_streams()
    await asyncio.wait_for(task, 5.0)
    assert time.monotonic() - t0 < 2.0 and names and set(names) == {"progress"}  # no terminal event: not finished
    assert [n async for n, _ in svc.events("a", job.id)] == []  # a new stream ends at once too
    gate.release.set()
    assert (await finished(svc, "a", job.id)).status == "succeeded"
