"""The quantd command: in-process quantize/analyze, --server paths, jobs, --json and exit codes."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quantd.cli import main
from quantd_client._client import Client
from quantd_client._results import Artifact

W = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    src = tmp_path / "m.npz"
    np.savez(src, **{"layer.weight": W, "layer.bias": np.zeros(16, np.float32)})
    return src


def test_quantize_in_process_prints_table(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.safetensors"
    assert main(["quantize", str(model), "-o", str(out), "--dtype", "int4", "--group-size", "32",
                 "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"layer\.weight\s+16x64\s+int4/group", text)
    assert "skipped: 1-D" in text and "tensors quantized" in text
    deq = Artifact(path=out).dequantize()["layer.weight"]
    assert np.abs(deq - W).max() < np.abs(W).max() / 7


def test_file_outputs_get_their_folders(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "deeper" / "o.safetensors"
    assert main(["quantize", str(model), "-o", str(out), "--dtype", "int8", "--device", "cpu", "--json"]) == 0
    dense = tmp_path / "dense" / "model.safetensors"
    assert main(["dequantize", str(out), "-o", str(dense), "--json"]) == 0
    capsys.readouterr()
    assert Artifact(path=out).dequantize()["layer.weight"].shape == (16, 64) and dense.stat().st_size > 0


def test_quantize_json_and_config_file(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"scheme": {"dtype": "int4", "group_size": 32},
                               "rules": [{"match": "layer.weight", "scheme": {"dtype": "int8", "granularity": "channel"}}]}))
    out = tmp_path / "o.safetensors"
    assert main(["quantize", str(model), "-o", str(out), "--config", str(cfg), "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (w,) = [t for t in report["tensors"] if t["name"] == "layer.weight"]
    assert w["scheme"]["dtype"] == "int8" and w["scheme"]["granularity"] == "channel"
    assert report["summary"]["tensors_quantized"] == 1


def test_flags_override_config_file(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"scheme": {"dtype": "int4", "group_size": 32}}))
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--config", str(cfg), "--dtype", "int8",
                 "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"][0]["scheme"]["dtype"] == "int8" and report["tensors"][0]["scheme"]["group_size"] == 32


@pytest.mark.parametrize(("argv", "code", "needle"), [
    (["--dtype", "int4", "--group-size", "48"], 1, "group_size"),   # cannot apply: the engine's 422
    (["--dtype", "int5"], 2, "dtype"),                               # invalid config: usage error
    (["--dtype", "uint4", "--symmetric"], 2, "symmetric"),
])
def test_failures_exit_nonzero_with_detail(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           argv: list[str], code: int, needle: str) -> None:
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--device", "cpu", *argv]) == code
    err = capsys.readouterr().err
    assert err.startswith("quantd quantize:") and needle in err


@pytest.mark.parametrize("text", ['[1, 2]', '"int4"', 'null', '{"scheme": [1]}', '{"scheme": "int4"}'])
def test_a_config_file_that_is_not_an_object_is_a_usage_error(model: Path, tmp_path: Path, text: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(text)  # valid JSON, not a config: a one-line usage error
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--config", str(cfg), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantd quantize: --config") and "JSON object" in err


def test_group_size_flag_asks_for_groups_over_a_per_channel_config(model: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"scheme": {"dtype": "int8", "granularity": "channel"}}))
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--config", str(cfg), "--dtype", "int4",
                 "--group-size", "16", "--device", "cpu", "--json"]) == 0
    scheme = json.loads(capsys.readouterr().out)["tensors"][0]["scheme"]
    assert (scheme["granularity"], scheme["group_size"]) == ("group", 16)  # --group-size asks for groups


def test_missing_input_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(tmp_path / "nope.npz"), "-o", str(tmp_path / "o"), "--device", "cpu"]) == 1
    assert "nope.npz" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cuda", "cuda:7"], ids=["any-gpu", "gpu-7"])  # not "cuda": a skip mark
def test_a_cuda_device_that_is_not_there_is_a_usage_error(model: Path, tmp_path: Path, device: str,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import quantd.server.main

    if torch.cuda.device_count() > (7 if device == "cuda:7" else 0):
        pytest.skip("this machine has the device")
    monkeypatch.setattr(quantd.server.main, "run_server", lambda *a, **k: pytest.fail("the server started"))
    # quantize/analyze died in torch with a traceback, serve in its lifespan
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--device", device]) == 2
    err = capsys.readouterr().err
    assert "field 'device'" in err and "CUDA device" in err and "Traceback" not in err
    for workers in ("1", "0"):  # API only: the sync endpoints would still run on it
        assert main(["serve", "--device", device, "--workers", workers, "--data-dir", str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("quantd serve:") and "CUDA device" in err


def test_a_name_that_is_no_device_is_a_usage_error(model: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # "gpu" reached torch from quantize and analyze (a RuntimeError traceback, exit 1); serve refused it
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--device", "gpu"]) == 2
    assert main(["analyze", str(model), "--dtype", "int8", "--device", "gpu"]) == 2
    monkeypatch.setenv("QUANTD_DEVICE", "gpu")
    assert main(["quantize", str(model), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("'gpu' is not auto, cpu, cuda or cuda:N") == 3 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_analyze_in_process_side_by_side(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(model), "--dtype", "int8", "--dtype", "int4", "--group-size", "32",
                 "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (t,) = data["tensors"]
    sqnr8, sqnr4 = (r["stats"]["sqnr_db"] for r in t["results"])
    assert sqnr8 > sqnr4 + 15
    assert [o["sqnr_db"] for o in data["overall"]] == pytest.approx([sqnr8, sqnr4])
    assert main(["analyze", str(model), "--dtype", "int8", "--dtype", "int4", "--group-size", "32",
                 "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "int8/g32/asym" in text and "int4/g32/asym" in text and "(overall)" in text and "bits/weight" in text


def test_analyze_with_analyses_prints_their_tables(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(model), "--dtype", "int4", "--group-size", "32", "--device", "cpu",
                 "--analysis", "bit_widths", "--analysis", "scale_sensitivity", "--json"]) == 0
    (t,) = json.loads(capsys.readouterr().out)["tensors"]
    assert [b["dtype"] for b in t["analyses"]["bit_widths"]] == ["int8", "int4", "int3", "int2"]
    assert t["analyses"]["outlier_impact"] is None and len(t["analyses"]["scale_sensitivity"]) == 6
    assert main(["analyze", str(model), "--dtype", "int4", "--group-size", "32", "--device", "cpu",
                 "--analysis", "outlier_impact"]) == 0
    assert "outlier impact" in capsys.readouterr().out


@pytest.mark.slow
def test_server_paths(cli_server: str, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.safetensors"
    assert main(["quantize", str(model), "-o", str(out), "--dtype", "int8", "--group-size", "32",
                 "--server", cli_server, "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the job's Report: the same shape as in-process
    assert re.search(r"job [0-9a-f]+ submitted", captured.err)  # the id, to follow the job if interrupted
    summary = report["summary"]
    assert summary["tensors_quantized"] == 1 and summary["tensors_skipped"] == 1
    assert main(["quantize", str(model), "-o", str(tmp_path / "l.safetensors"), "--dtype", "int8", "--group-size",
                 "32", "--device", "cpu", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert report.keys() == local.keys() and report["job_id"] and [t["stats"] for t in report["tensors"]] == \
        [t["stats"] for t in local["tensors"]]
    assert np.abs(Artifact(path=out).dequantize()["layer.weight"] - W).max() < np.abs(W).max() / 250

    assert main(["info", "--server", cli_server, "--json"]) == 0
    assert "int4" in json.loads(capsys.readouterr().out)["dtypes"]
    assert main(["info", "--server", cli_server]) == 0
    table = capsys.readouterr().out  # method arguments as their types read
    assert " iters=2 " in table and "act_order=true" in table and "iters=2.0" not in table
    assert "compressed-tensors" in table and "gguf" in table and "channel" in table  # output formats, granularities

    with Client(cli_server) as c:
        job = c.submit(model, {"scheme": {"dtype": "int4", "group_size": 32}}, progress=False)
        job.wait(timeout=120, progress=False)
    assert main(["jobs", "list", "--server", cli_server, "--json"]) == 0
    assert job.id in [j["id"] for j in json.loads(capsys.readouterr().out)]
    assert main(["jobs", "show", job.id, "--server", cli_server]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "succeeded"
    dst = tmp_path / "job.safetensors"
    assert main(["jobs", "download", job.id, "-o", str(dst), "--server", cli_server]) == 0
    assert "saved" in capsys.readouterr().out
    assert Artifact(path=dst).dequantize()["layer.weight"].shape == (16, 64)

    assert main(["jobs", "show", "missing-job", "--server", cli_server]) == 1
    assert "quantd jobs: [404]" in capsys.readouterr().err
    assert main(["analyze", str(model), "--group-size", "32", "--server", cli_server]) == 0
    assert "(overall)" in capsys.readouterr().out


def test_unreachable_server_exits_1(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "list", "--server", "http://127.0.0.1:9", "--timeout", "2"]) == 1
    assert "ConnectError" in capsys.readouterr().err


def test_in_process_work_without_the_server_extra_says_what_to_install(model: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "quantd.io.pipeline", None)  # as on the SDK-only install: no torch
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantd quantize:") and "quantd[server]" in err and "--server" in err


def test_serve_keeps_compiled_kernels_in_its_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Inductor's default cache is /tmp/torchinductor_<user>: outside the data dir.
    import os
    import platform

    import torch

    from quantd.runtime import keep_kernel_cache_in

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "recorded")  # so that teardown restores the original
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    keep_kernel_cache_in(tmp_path / "data")
    # one directory per CPU vector ISA and feature set: Inductor's caches do not key on them
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert cache.parent == (tmp_path / "data").resolve() / ".inductor-cache"
    assert cache.name.startswith(f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}".lower())
    if Path("/proc/cpuinfo").exists():
        assert len(cache.name.rsplit("-", 1)[1]) == 8  # the flags' hash
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    keep_kernel_cache_in(tmp_path / "data")  # an explicit setting wins
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_in_process_runs_keep_compiled_kernels_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       model: Path) -> None:
    # The CLI's in-process engine uses Inductor's default cache dir, one subdirectory per kind of CPU: that
    # dir outlives machines in images and snapshots, and kernels compiled for one CPU's ISA do not suit another.
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from quantd.runtime import cpu_kernel_tag

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "recorded")  # so that teardown restores the original
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr("quantd.io.pipeline.quantize_file", _refuse)  # only the cache dir is looked at
    with pytest.raises(RuntimeError, match="not run"):
        main(["quantize", str(model), "-o", str(tmp_path / "o"), "--device", "cpu"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(Path(default_cache_dir()) / cpu_kernel_tag())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="sets glibc's malloc")
def test_keep_freed_memory_serves_large_blocks_from_the_heap_in_worker_threads() -> None:
    # By default glibc maps every block of 32 MiB and more anew and unmaps it when freed, so each large
    # tensor faults its pages in again. With the setting a worker thread's 96 MiB tensor comes from the one
    # heap (below the program break), where a freed block stays to be reused.
    script = (
        "import ctypes, sys, threading\n"
        "import torch\n"
        "from quantd.runtime import keep_freed_memory\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]\n"
        "done = keep_freed_memory(sys.argv[1] == 'on')\n"
        "where = []\n"
        "def work():\n"
        "    for _ in range(3):\n"
        "        t = torch.empty(96 << 20, dtype=torch.uint8)\n"
        "        where.append('heap' if t.data_ptr() < libc.sbrk(0) else 'mapped')\n"
        "        del t\n"
        "t = threading.Thread(target=work)\n"
        "t.start()\n"
        "t.join()\n"
        "print(done, *where)\n"
    )
    env = {k: v for k, v in os.environ.items()  # another allocator or glibc tunables would decide instead
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    runs = {mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120,
                                 check=True, env=env).stdout.split() for mode in ("on", "off")}
    assert runs == {"on": ["True", "heap", "heap", "heap"], "off": ["False", "mapped", "mapped", "mapped"]}


def test_keep_freed_memory_follows_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd import runtime
    from quantd.server.settings import Settings

    seen: list[bool] = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda enabled: seen.append(enabled) or enabled)
    monkeypatch.delenv("QUANTD_KEEP_FREED_MEMORY")
    assert runtime.keep_freed_memory_as_configured() is True  # on by default
    for raw, want in (("0", False), ("off", False), ("true", True), ("1", True)):
        monkeypatch.setenv("QUANTD_KEEP_FREED_MEMORY", raw)
        assert runtime.keep_freed_memory_as_configured() is want
    assert seen == [True, False, False, True, True]
    assert Settings(keep_freed_memory="no").keep_freed_memory is False  # serve and worker
    assert Settings.model_fields["keep_freed_memory"].default is runtime.KEEP_FREED_MEMORY_DEFAULT
    monkeypatch.setenv("QUANTD_KEEP_FREED_MEMORY", "sometimes")
    with pytest.raises(ValueError, match="QUANTD_KEEP_FREED_MEMORY: not a boolean"):
        runtime.keep_freed_memory_as_configured()


def test_a_bad_keep_freed_memory_value_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("QUANTD_KEEP_FREED_MEMORY", "sometimes")
    monkeypatch.setattr("quantd.io.pipeline.quantize_file", _refuse)
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == "quantd quantize: settings: QUANTD_KEEP_FREED_MEMORY: not a boolean (1/0, true/false, on/off, yes/no)\n"


def _refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("not run")


def test_bad_settings_are_one_line_naming_the_variable_and_never_its_value(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # One line naming the variable, never echoing its value (it holds secrets).
    monkeypatch.setenv("QUANTD_API_KEYS", "tenant-a:sk-live-0123456789abcdef,bad")
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "QUANTD_API_KEYS" in err and "sk-live" not in err
    monkeypatch.delenv("QUANTD_API_KEYS")
    monkeypatch.setenv("QUANTD_MAX_UPLOAD_BYTES", "10GiB")
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantd serve: settings: QUANTD_MAX_UPLOAD_BYTES:") and err.count("\n") == 1


def test_output_that_is_the_input_is_refused(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = model.read_bytes()
    assert main(["quantize", str(model), "-o", str(model), "--device", "cpu"]) == 2
    assert "is the input file" in capsys.readouterr().err and model.read_bytes() == before


def test_cosines_are_shown_to_six_decimals(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(model), "--dtype", "int8", "--granularity", "channel", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    block = text.split("cosine\n", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"layer\.weight\s+0\.99\d{4}\b", block)  # it read "1" at 4 significant digits


_COMPILER_STACK_PROBE = """
import sys
from quantd.cli import main
code = main(["quantize", sys.argv[1], "-o", sys.argv[2], "--group-size", "32", "--device", "cpu"])
print(code, *sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


@pytest.mark.parametrize("setting", ["auto", "0"])
def test_a_small_one_shot_run_never_imports_the_compiler_stack(model: Path, tmp_path: Path, setting: str) -> None:
    # Importing Dynamo and Inductor alone costs a one-shot run more than compiled kernels save on a small
    # model: with QUANTD_COMPILE=auto (the default) or off, the run stays eager and never imports them.
    env = {**os.environ, "QUANTD_COMPILE": setting}
    out = subprocess.run([sys.executable, "-c", _COMPILER_STACK_PROBE, str(model), str(tmp_path / "o.safetensors")],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    assert out.stdout.splitlines()[-1].split() == ["0"], out.stdout + out.stderr[-2000:]


def test_one_shot_runs_compile_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd import runtime
    from quantd.engine.kernels import KERNELS

    for setting, compiled in (("auto", False), ("1", True), ("0", False)):
        monkeypatch.setenv("QUANTD_COMPILE", setting)
        KERNELS.reset(available=None)
        assert runtime.use_kernels_for(tmp_path) == (compiled and KERNELS.available()), setting
        assert KERNELS.available() == (compiled and bool(__import__("shutil").which("c++"))), setting
    KERNELS.reset(available=None)


def test_a_large_one_shot_gguf_run_compiles_its_kernels_under_auto(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Under auto a one-shot GGUF run takes the compiled ggml kernels when its ggml-type weights reach the
    threshold per torch thread (the build then costs less than the kernels save), and only then; other
    outputs, and QUANTD_COMPILE=0, stay eager."""
    import math
    import threading

    import torch

    from _gguf_models import write_tiny_llama
    from quantd import runtime
    from quantd.engine.ggml import _common
    from quantd.engine.kernels import KERNELS
    from quantd.io.gguf_file import GGUFFile
    from quantd.io.outputs.gguf import ggml_weights
    from quantd_client import QuantConfig

    src = write_tiny_llama(tmp_path / "tiny-f32.gguf")
    q4 = QuantConfig(output="gguf", gguf_mix="Q4_K_M")  # type: ignore[arg-type]
    weights = ggml_weights(src, q4)
    assert 0 < weights < sum(math.prod(t.ne) for t in GGUFFile(src).tensors)  # the norms stay float
    assert ggml_weights(src, QuantConfig(output="gguf", scheme={"dtype": "float16"})) == 0  # no ggml type
    # Inputs and configs the run itself refuses (and says why): counted as nothing, never raised here.
    assert ggml_weights(src, QuantConfig()) == 0  # int4: not a type GGUF holds
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(src.read_bytes()[:100])
    other = tmp_path / "w.safetensors"
    __import__("safetensors.torch").torch.save_file({"w": torch.ones(4, 4)}, str(other))
    for path in (tmp_path, truncated, other, tmp_path / "missing.gguf"):
        assert ggml_weights(path, q4) == 0, path
    threads = torch.get_num_threads()
    for per_thread, config, setting, expected in (
            (weights // threads, q4, "auto", True),  # reaches the threshold
            (weights // threads + 1, q4, "auto", False),
            (0, QuantConfig(), "auto", False),  # safetensors output: eager whatever the size
            (0, q4, "0", False)):
        monkeypatch.setenv("QUANTD_COMPILE", setting)
        monkeypatch.setattr(runtime, "gguf_kernels_cached", lambda: False)  # the cold threshold, whatever the cache
        monkeypatch.setattr(runtime, "ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD", per_thread)
        monkeypatch.setattr(_common.KQUANT_KERNELS, "built", threading.Event())
        KERNELS.reset(available=None)
        taken = runtime.use_kernels_for(src, config)
        assert taken == (expected and KERNELS.available()), (per_thread, setting)
        assert _common.KQUANT_KERNELS.built.is_set() == expected, (per_thread, setting)
    KERNELS.reset(available=None)


def test_a_warmed_kernel_cache_lowers_the_one_shot_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``quantd warm-up`` fills the CLI's kernel cache and marks it (for this torch and this code); a one-shot
    GGUF run then takes the compiled kernels from the warm threshold, not the cold one."""
    import threading

    import torch

    from _gguf_models import write_tiny_llama
    from quantd import runtime
    from quantd.engine.ggml import _common
    from quantd.engine.kernels import KERNELS
    from quantd.io.outputs import gguf as gguf_out
    from quantd.io.outputs.gguf import ggml_weights
    from quantd_client import QuantConfig

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QUANTD_COMPILE", "auto")
    src = write_tiny_llama(tmp_path / "tiny-f32.gguf")
    q4 = QuantConfig(output="gguf", gguf_mix="Q4_K_M")  # type: ignore[arg-type]
    per_thread = ggml_weights(src, q4) // torch.get_num_threads()
    monkeypatch.setattr(runtime, "ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD", per_thread + 1)  # cold: not reached
    monkeypatch.setattr(runtime, "WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD", per_thread)  # warm: reached

    def decided() -> bool:
        monkeypatch.setattr(_common.KQUANT_KERNELS, "built", threading.Event())
        KERNELS.reset(available=None)
        runtime.use_kernels_for(src, q4)
        return _common.KQUANT_KERNELS.built.is_set()

    assert not runtime.gguf_kernels_cached() and not decided()
    built: list[bool] = []
    monkeypatch.setattr(gguf_out, "warm_up_gguf", lambda: built.append(True) or 1.5)
    if not KERNELS.available():
        assert main(["warm-up"]) == 2
        return
    assert main(["warm-up", "--json"]) == 0
    assert built == [True] and json.loads(capsys.readouterr().out)["kernel_cache"] == str(tmp_path / "cache")
    assert runtime.gguf_kernels_cached() and decided()
    monkeypatch.setattr(runtime, "_gguf_kernels_key", lambda: "another-torch-or-code")
    assert not runtime.gguf_kernels_cached() and not decided()
    KERNELS.reset(available=None)


def test_the_quantize_command_decides_its_kernels_with_its_config(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from _gguf_models import write_tiny_llama
    from quantd import runtime

    seen: list[tuple[Path, object]] = []
    monkeypatch.setattr(runtime, "use_kernels_for", lambda path, config=None: seen.append((path, config)) or False)
    src = write_tiny_llama(tmp_path / "tiny-f32.gguf")
    assert main(["quantize", str(src), "--gguf-mix", "Q8_0", "-o", str(tmp_path / "o.gguf"), "--json"]) == 0
    [(path, config)] = seen
    assert path == src and getattr(config, "gguf_mix", None) == "Q8_0" and getattr(config, "output", None) == "gguf"


def test_int8_defaults_to_per_channel_and_embeddings_stay_in_full_precision(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.npz"
    np.savez(src, **{"layer.weight": W, "model.embed_tokens.weight": W[:2], "lm_head.weight": W})
    assert main(["quantize", str(src), "-o", str(tmp_path / "o"), "--dtype", "int8", "--device", "cpu",
                 "--json"]) == 0
    tensors = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    w = tensors["layer.weight"]
    assert (w["scheme"]["granularity"], w["skipped"]) == ("channel", False)
    assert w["stats"]["bits_per_weight"] == pytest.approx(8 + 24 / 64)  # one fp16 scale and int8 zero point a row
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert tensors[name]["skipped"] and "skip_embeddings" in tensors[name]["reason"]
    # Explicit choices keep their meaning: groups when asked for, embeddings when asked for.
    assert main(["quantize", str(src), "-o", str(tmp_path / "o"), "--dtype", "int8", "--granularity", "group",
                 "--group-size", "32", "--quantize-embeddings", "--device", "cpu", "--json"]) == 0
    tensors = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert all(not t["skipped"] and t["scheme"]["granularity"] == "group" for t in tensors.values())


def test_skip_globs_leave_tensors_as_they_are(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"skip_1d": False, "rules": [{"match": "layer.*", "scheme": {"dtype": "int8"}}]}))
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--config", str(cfg), "--skip", "*.weight",
                 "--skip", "nothing*", "--device", "cpu", "--json"]) == 0
    tensors = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert tensors["layer.weight"]["skipped"] and tensors["layer.weight"]["reason"] == "rule '*.weight': skip"
    assert not tensors["layer.bias"]["skipped"]  # the file's rule still applies to the rest
    out = tmp_path / "o"
    assert np.array_equal(Artifact(path=out).dequantize()["layer.weight"], W)


def _closed_reader(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with its stdout a pipe whose reader has already gone (``cmd | head -0``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        os.close(write)


@pytest.mark.parametrize("where", ["in-process", "server"])
def test_a_closed_pipe_ends_quietly(where: str, model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    base = [sys.executable, "-m", "quantd"]
    if where == "server":
        cmd = [*base, "jobs", "list", "--server", request.getfixturevalue("cli_server")]
    else:
        cmd = [*base, "quantize", str(model), "-o", str(tmp_path / "o"), "--dtype", "int8", "--device", "cpu"]
    done = _closed_reader(cmd)
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE, as `head` leaves any other tool
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr and "Exception" not in done.stderr


def test_one_shot_runs_single_thread_their_own_ops_only_for_chunk_work() -> None:
    # Round to nearest is the engine's chunk loops (spread over engine.parallel's pool); the methods and
    # calibration multiply large matrices, which keep OpenMP's threads.
    from quantd.cli import _chunk_work_only
    from quantd_client import Scheme, SchemeOverride

    assert _chunk_work_only([Scheme(dtype="int4"), SchemeOverride(dtype="int8")])
    assert not _chunk_work_only([Scheme(dtype="int4", method="gptq")])
    assert not _chunk_work_only([Scheme(dtype="int4"), SchemeOverride(method="hqq")])
    assert not _chunk_work_only([Scheme(dtype="int4")], calibration="calibration.safetensors")
    assert not _chunk_work_only([Scheme(dtype="int4")], output="gguf")


def test_the_program_ends_as_the_interpreter_would_then_skips_its_teardown(model: Path, tmp_path: Path) -> None:
    # `quantd` exits without the interpreter's teardown once torch is loaded: the artifact, the printed
    # report, the atexit hooks and the exit status must all be as a normal exit leaves them.
    marker, out = tmp_path / "atexit-ran", tmp_path / "o.safetensors"
    code = ("import atexit, pathlib, sys\n"
            f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('ran'))\n"
            "from quantd.cli import run\n"
            "sys.argv = ['quantd', *sys.argv[1:]]\n"
            "run()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code, "quantize", str(model), "-o", str(out), "--dtype", "int8",
                           "--device", "cpu", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "ran"
    report = json.loads(done.stdout)
    assert report["tensors"] and out.stat().st_size > 0
    bad = subprocess.run([sys.executable, "-c", code, "quantize", str(model), "-o", str(out), "--dtype", "int3",
                          "--device", "cpu"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "group_size 128 does not divide" in bad.stderr


def test_an_interrupted_remote_quantize_says_the_job_goes_on(cli_server: str, model: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd_client._job import JobHandle

    def interrupted(self: JobHandle, *a: object, **k: object) -> JobHandle:
        raise KeyboardInterrupt

    monkeypatch.setattr(JobHandle, "wait", interrupted)
    rc = main(["quantize", str(model), "-o", str(tmp_path / "o.safetensors"), "--dtype", "int8",
               "--server", cli_server])
    err = capsys.readouterr().err
    job_id = err.split("job ", 1)[1].split()[0]
    assert rc == 130 and f"quantd jobs cancel {job_id} stops it" in err and "goes on" in err


def test_a_server_url_without_its_scheme_is_a_usage_error(model: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(model), "-o", str(tmp_path / "o"), "--server", "localhost:8000"]) == 2
    assert "--server 'localhost:8000' is not an http:// or https:// URL" in capsys.readouterr().err
    assert main(["jobs", "list", "--server", "127.0.0.1:8000"]) == 2


def test_a_config_level_refusal_reads_as_one_line_with_the_flag_to_use(model: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(model), "-o", str(tmp_path / "o.gguf"), "--dtype", "q4_k", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "config: scheme.dtype: q4_k is a ggml block type" in err and "--format gguf" in err
    assert "Value error" not in err and "config: :" not in err


@pytest.mark.parametrize("argv", [["jobs", "list", "--limit", "0"], ["jobs", "list", "--limit", "-3"],
                                  ["info", "--timeout", "-1"], ["info", "--timeout", "nan"],
                                  ["info", "--timeout", "inf"], ["info", "--timeout", "1e12"],
                                  ["quantize", "x.npy", "-o", "y", "--server", "http://127.0.0.1:9", "--wait-timeout", "0"]])
def test_values_a_command_does_not_take_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's own exit, before any request
        main(argv)
    assert e.value.code == 2 and "must be above 0" in capsys.readouterr().err


def test_an_unknown_compile_setting_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("QUANTD_COMPILE", "banana")
    assert main(["serve", "--data-dir", str(tmp_path / "d")]) == 2
    assert "QUANTD_COMPILE: 'banana'" in capsys.readouterr().err
    assert main(["info", "--server", "http://127.0.0.1:9", "--timeout", "1"]) == 1  # a client: not its setting
    capsys.readouterr()
    monkeypatch.setenv("QUANTD_COMPILE", "")  # empty: unset
    assert main(["quantize", str(tmp_path / "missing.npy"), "-o", str(tmp_path / "x"), "--device", "cpu"]) == 1
    monkeypatch.setenv("QUANTD_COMPILE", " Auto ")
    src = tmp_path / "w.npy"
    np.save(src, W)
    assert main(["quantize", str(src), "-o", str(tmp_path / "o.safetensors"), "--dtype", "int8", "--device", "cpu"]) == 0
