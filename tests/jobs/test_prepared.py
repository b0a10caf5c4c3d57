"""Quantizing an upload while it streams in: the growing-file reader, PreparedRun and its adoption by a job."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from jobs_support import CONFIG, make_upload, wait_for
from safetensors.torch import load_file, save_file

from quantd.errors import JobCancelled
from quantd.io.growing import GrowingFile, UploadAborted
from quantd.io.pipeline import quantize_file
from quantd.io.readers import SafetensorsReader
from quantd.jobs import JobService
from quantd.jobs.prepared import NotStreamable, PreparedRun, PreparedRuns
from quantd_client import ErrorStats, Progress, QuantConfig

MakeService = Callable[..., JobService]
INT4 = QuantConfig.model_validate({"scheme": {"dtype": "int4", "group_size": 32}})


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.weight": torch.randn(64, 256, generator=g) * (i + 1) for i in range(4)}
    tensors["layers.0.bias"] = torch.randn(64, generator=g)
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    return path


class Uploader:
    """Copies ``src`` into ``dst`` piece by piece as an upload does, telling ``sink`` after each piece;
    ``until(n)`` lets it write up to byte n and waits until it has."""

    def __init__(self, src: Path, dst: Path, sink: GrowingFile | PreparedRun) -> None:
        self.data, self.dst, self.sink = src.read_bytes(), dst, sink
        self.written = 0
        self._allowed = 0
        self._cond = threading.Condition()
        self._fh = open(dst, "wb")  # noqa: SIM115 - closed when the upload ends
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.written < len(self.data):
            with self._cond:
                self._cond.wait_for(lambda: self._allowed > self.written)
                end = min(self._allowed, len(self.data))
            self._fh.write(self.data[self.written:end])
            self._fh.flush()
            with self._cond:
                self.written = end
                self._cond.notify_all()
            self.sink.advance(end)
        self._fh.close()
        self.sink.complete()

    def until(self, n: int) -> None:
        with self._cond:
            self._allowed = max(self._allowed, n)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.written >= min(n, len(self.data)))

    def finish(self) -> None:
        self.until(len(self.data))
        self._thread.join(10)


def assert_same_stats(mine: ErrorStats, theirs: ErrorStats) -> None:
    """Codes and scales are bit-identical on every path; the statistics' float64 sums may be taken in
    another order (compiled or eager kernels), so they agree to ~1e-12 relative, as documented."""
    a, b = mine.model_dump(), theirs.model_dump()
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float) and isinstance(b[k], float):
            assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-300), k
        else:
            assert a[k] == b[k], k


def in_thread(fn: Callable[[], object], catch: type[BaseException]) -> tuple[threading.Thread, list[BaseException]]:
    """``fn`` started on a thread; the list receives what it raises of type ``catch``."""
    caught: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except catch as e:
            caught.append(e)

    t = threading.Thread(target=body)
    t.start()
    return t, caught


def _data_end(path: Path, name: str) -> int:
    with SafetensorsReader(path) as r:
        e = r.header.entries[name]
        return r.header.data_start + e.end


# -- GrowingFile ---------------------------------------------------------------------------------------


def test_growing_file_reads_wait_for_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    src = GrowingFile(path)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(src.read(6)))
    reader.start()
    with open(path, "ab") as f:
        f.write(b"abc")
    src.advance(3)
    reader.join(0.2)
    assert reader.is_alive() and not got  # 3 of 6 bytes: still waiting
    with open(path, "ab") as f:
        f.write(b"defgh")
    src.advance(8)
    reader.join(5)
    assert got == [b"abcdef"]
    src.complete()
    assert src.read(10) == b"gh"  # complete: a short read at the end, as on a plain file
    assert src.final_size() == 8
    src.close()


def test_growing_file_abort_ends_a_waiting_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"xy")
    src = GrowingFile(path)
    src.advance(2)
    t, errors = in_thread(lambda: src.read(5), UploadAborted)
    src.abort()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
    with pytest.raises(UploadAborted):
        src.final_size()
    src.close()


def test_reader_over_a_growing_file_loads_tensors_as_their_bytes_land(big_model: Path, tmp_path: Path) -> None:
    dst = tmp_path / "upload"
    dst.write_bytes(b"")
    src = GrowingFile(dst)
    up = Uploader(big_model, dst, src)
    expected = load_file(str(big_model))
    loaded: dict[str, torch.Tensor] = {}
    done = threading.Event()

    def read_all() -> None:
        with SafetensorsReader(dst, src, size_bound=1 << 30) as reader:
            for t in reader.tensors:
                loaded[t.name] = reader.load(t.name, "cpu")
        done.set()

    threading.Thread(target=read_all, daemon=True).start()
    up.until(_data_end(big_model, "layers.0.weight"))
    wait_for(lambda: "layers.0.weight" in loaded, what="the first tensor, before the rest is uploaded")
    assert "layers.3.weight" not in loaded
    up.finish()
    assert done.wait(10)
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0)


# -- PreparedRun -----------------------------------------------------------------------------------------


def _run(tmp_path: Path, config: QuantConfig = INT4) -> tuple[PreparedRun, Path]:
    upload = tmp_path / "upload"
    upload.write_bytes(b"")
    run = PreparedRun(upload, tmp_path / "artifact.part", config, device="cpu", size_bound=1 << 30)
    run.start()
    return run, upload


def test_a_run_during_the_upload_equals_the_pipeline_on_the_stored_file(big_model: Path, tmp_path: Path) -> None:
    run, upload = _run(tmp_path)
    up = Uploader(big_model, upload, run)
    seen: list[Progress] = []
    up.until(_data_end(big_model, "layers.1.weight"))
    wait_for(lambda: run._last is not None and run._last.tensors_done >= 2, what="two tensors quantized mid-upload")
    assert not run.done.is_set()
    adopted: list[object] = []
    adopter = threading.Thread(target=lambda: adopted.append(run.adopt(seen.append, lambda: False)))
    adopter.start()
    up.finish()
    adopter.join(30)
    report = adopted[0]
    assert report is not None and run.artifact.is_file()
    assert seen[0].tensors_done >= 2 and seen[-1].tensors_done == seen[-1].tensors_total == 5
    ref = quantize_file(big_model, tmp_path / "ref.safetensors", INT4, device="cpu")
    assert [t.model_dump(exclude={"stats"}) for t in report.tensors] == [
        t.model_dump(exclude={"stats"}) for t in ref.tensors]
    for mine, theirs in zip(report.tensors, ref.tensors, strict=True):
        assert (mine.stats is None) == (theirs.stats is None)
        if mine.stats is not None and theirs.stats is not None:
            assert_same_stats(mine.stats, theirs.stats)
    assert report.summary.input_bytes == big_model.stat().st_size
    ours, ref_tensors = load_file(str(run.artifact)), load_file(str(tmp_path / "ref.safetensors"))
    assert ours.keys() == ref_tensors.keys()
    for name in ours:
        assert torch.equal(ours[name], ref_tensors[name]), name


def test_cancel_mid_upload_stops_the_run_and_deletes_its_artifact(big_model: Path, tmp_path: Path) -> None:
    run, upload = _run(tmp_path)
    up = Uploader(big_model, upload, run)
    up.until(_data_end(big_model, "layers.0.weight"))
    wait_for(lambda: run._last is not None and run._last.tensors_done >= 1, what="a tensor quantized")
    run.cancel()  # the upload failed: the run stops at its next tensor or its next wait for bytes
    assert run.done.wait(10)
    assert isinstance(run.error, (UploadAborted, JobCancelled))
    assert not run.artifact.exists()
    assert run.adopt(lambda p: None, lambda: False) is None
    up.finish()


def test_should_cancel_of_the_adopting_worker_ends_the_run_as_cancelled(big_model: Path, tmp_path: Path) -> None:
    run, upload = _run(tmp_path)
    up = Uploader(big_model, upload, run)
    up.until(_data_end(big_model, "layers.0.weight"))
    wait_for(lambda: run._last is not None and run._last.tensors_done >= 1, what="a tensor quantized")
    t, out = in_thread(lambda: run.adopt(lambda p: None, lambda: True), JobCancelled)  # a DELETE of the job
    up.finish()
    t.join(30)
    assert len(out) == 1 and not run.artifact.exists()


def test_a_run_over_another_format_is_not_usable(tmp_path: Path) -> None:
    run, upload = _run(tmp_path)
    upload.write_bytes(b"\x93NUMPY" + b"\x00" * 200)
    run.advance(206)
    run.complete()
    assert run.adopt(lambda p: None, lambda: False) is None
    assert isinstance(run.error, NotStreamable)


def test_runs_are_limited_to_the_capacity(tmp_path: Path) -> None:
    capacity = [1]
    n = iter(range(100))
    runs = PreparedRuns(new_artifact_path=lambda: tmp_path / f"a{next(n)}.part", capacity=lambda: capacity[0],
                        device=lambda: "cpu")
    (tmp_path / "u").write_bytes(b"")
    first = runs.start(tmp_path / "u", INT4, size_bound=1 << 20)
    assert first is not None
    assert runs.start(tmp_path / "u", INT4, size_bound=1 << 20) is None  # one worker idle, one run already
    runs.discard(first)
    assert first.done.wait(10)
    second = runs.start(tmp_path / "u", INT4, size_bound=1 << 20)
    assert second is not None
    runs.close()  # cancels the runs still waiting for their upload and stops the threads
    assert second.done.wait(10)


# -- JobService: a run filed under its job, adopted by the worker ------------------------------------------


def _service_with_a_run(make_service: MakeService, model: Path) -> tuple[JobService, Path, PreparedRun]:
    """A service running the real pipeline, and a run started over an upload of ``model`` (all written)."""
    svc = make_service(quantize_fn=None, quantize_during_upload=True)
    path = svc.new_upload_path()
    path.write_bytes(model.read_bytes())
    run = svc.prepare(path, CONFIG, size_bound=1 << 30)
    assert run is not None
    return svc, path, run


def test_job_adopts_the_run_of_its_upload(make_service: MakeService, big_model: Path) -> None:
    svc, path, run = _service_with_a_run(make_service, big_model)
    config = CONFIG
    run.advance(path.stat().st_size)
    run.complete()
    upload = make_upload(svc, path)
    job = asyncio.run(svc.submit(tenant="t", upload=upload, config=config, prepared=run))
    assert svc._prepared is not None
    wait_for(lambda: asyncio.run(svc.get("t", job.id)).status == "succeeded", what="the job")
    assert svc._prepared.adopted == 1
    report = asyncio.run(svc.report("t", job.id))
    ref = quantize_file(big_model, big_model.with_suffix(".ref"), config, device="cpu")
    for mine, theirs in zip(report.tensors, ref.tensors, strict=True):
        assert (mine.stats is None) == (theirs.stats is None)
        if mine.stats is not None and theirs.stats is not None:
            assert_same_stats(mine.stats, theirs.stats)
    assert report.job_id == job.id
    assert not list(svc.storage.tmp.glob("run-*"))  # the run's artifact became the job's


def test_a_job_with_a_calibration_file_does_not_use_the_run(make_service: MakeService, big_model: Path,
                                                            tmp_path: Path) -> None:
    svc, path, run = _service_with_a_run(make_service, big_model)
    config = CONFIG
    calib_src = tmp_path / "calib.safetensors"
    save_file({"layers.0": torch.randn(8, 256)}, str(calib_src))
    job = asyncio.run(svc.submit(tenant="t", upload=make_upload(svc, path), config=config,
                                 calibration=make_upload(svc, calib_src), prepared=run))
    assert run.done.wait(10) and run.report is None  # discarded at submit
    wait_for(lambda: asyncio.run(svc.get("t", job.id)).status == "succeeded", what="the job")
    assert svc._prepared is not None and svc._prepared.adopted == 0
    assert asyncio.run(svc.report("t", job.id)).activations


def test_no_runs_with_a_stand_in_pipeline_or_when_turned_off(make_service: MakeService, tmp_path: Path) -> None:
    (tmp_path / "u").write_bytes(b"")
    config = CONFIG
    assert make_service(data_dir=tmp_path / "a").prepare(tmp_path / "u", config, size_bound=1) is None
    off = make_service(data_dir=tmp_path / "b", quantize_fn=None, quantize_during_upload=False)
    assert off.prepare(tmp_path / "u", config, size_bound=1) is None


def test_a_run_holds_its_workers_place_and_a_cancelled_job_stops_its_run(make_service: MakeService,
                                                                         big_model: Path) -> None:
    """While a run computes (its upload moving), the idle worker it stands for claims nothing: the job stays
    queued, so a DELETE cancels it there, which stops the run and deletes its artifact."""
    svc, path, run = _service_with_a_run(make_service, big_model)
    run.advance(path.stat().st_size // 2)  # the upload is still coming: the run holds the worker's place
    job = asyncio.run(svc.submit(tenant="t", upload=make_upload(svc, path), config=CONFIG, prepared=run))
    time.sleep(0.3)  # several of the worker's poll periods (0.05 s): it must not claim meanwhile
    assert asyncio.run(svc.get("t", job.id)).status == "queued"
    assert asyncio.run(svc.cancel("t", job.id)).status == "cancelled"
    assert run.done.wait(10) and run.report is None
    assert not list(svc.storage.tmp.glob("run-*"))


def test_a_stalled_upload_gives_its_workers_place_back(make_service: MakeService, big_model: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.jobs import prepared

    monkeypatch.setattr(prepared, "STALL_S", 0.2)
    svc, _, run = _service_with_a_run(make_service, big_model)
    run.advance(100)  # then nothing more: a client that stopped sending
    other = asyncio.run(svc.submit(tenant="t", upload=make_upload(svc, big_model), config=CONFIG))
    wait_for(lambda: asyncio.run(svc.get("t", other.id)).status == "succeeded", what="the other job")
    svc.discard_prepared(run)
    assert run.done.wait(10)
