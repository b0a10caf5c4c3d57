"""quantd as ``llama-quantize``: speed and per-tensor error of quantd's GGUF output against llama.cpp's own
quantizer (``llama_model_quantize`` of llama-cpp-python) on the same GGUF, in one run.

The model is a llama-architecture GGUF written here with gguf-py (no download): ``--layers`` blocks of
``--embd``/``--ff`` widths, a ``--vocab``-row embedding and output, weights drawn from a Student t
distribution (5 degrees of freedom: heavier tails than a Gaussian, as trained weights have) scaled by
1/sqrt(fan-in). For each mix, quantd (in-process, torch with ``--threads`` threads) and llama.cpp (with 1
and with ``--threads`` threads) quantize the same file; every quantized tensor of both outputs is decoded
with the same ggml decoder and compared with the same float32 input. Writes ``bench/results/gguf.json``.

quantd runs twice per mix: with its compiled CPU kernels, as a server or worker runs a GGUF job once its
warm-up has built them (``warm_up_gguf`` under ``QUANTD_COMPILE=auto``, timed on a cold kernel cache as
``kernel_warmup_s`` and again in a new process on the cache it filled as ``kernel_warmup_cached_s``, a
restarted server's; ``graphs_compiled_after_warmup`` counts what the timed runs still had to compile), and
on the eager torch ops. A third, instrumented
run gives the ``profile``: where quantd's time goes per mix (reading and converting the input, the finite
check, each k-quant stage, the statistics, writing), in seconds. With the compiled kernels a k-quant tensor's
chunks run in turn, each kernel on all threads (wall seconds); the legacy types' chunks run on the chunk
threads, their stages summed over them (thread-seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path += [str(HERE), str(HERE.parent / "tests")]

from common import log, machine_info, private_inductor_cache, write_results  # noqa: E402

FILE_TYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}


def write_model(path: Path, *, embd: int, ff: int, layers: int, vocab: int, seed: int = 0) -> Path:
    import gguf

    from _gguf_models import vocab as tiny_vocab

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(embd // 64)
    w.add_head_count_kv(embd // 256)
    w.add_rope_dimension_count(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    tokens, scores, types = tiny_vocab()
    extra = vocab - len(tokens)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens + [f"▁w{i}" for i in range(extra)])
    w.add_token_scores(scores + [-100.0 - i for i in range(extra)])
    w.add_token_types(types + [1] * extra)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_t(5, (rows, cols)) / np.sqrt(cols * 5 / 3)).astype(np.float32)

    kv = embd // 4
    w.add_tensor("token_embd.weight", mat(vocab, embd))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, np.float32))
        for name, shape in (("attn_q", (embd, embd)), ("attn_k", (kv, embd)), ("attn_v", (kv, embd)),
                            ("attn_output", (embd, embd)), ("ffn_gate", (ff, embd)), ("ffn_up", (ff, embd)),
                            ("ffn_down", (embd, ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(embd, np.float32))
    w.add_tensor("output_norm.weight", np.ones(embd, np.float32))
    w.add_tensor("output.weight", mat(vocab, embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_errors(src: Path, out: Path) -> dict[str, dict[str, Any]]:
    """Per quantized tensor of ``out``: its ggml type and the mse of its decode against ``src``'s tensor."""
    from quantd.engine import ggml
    from quantd.io.gguf_file import GGUFReader

    errs: dict[str, dict[str, Any]] = {}
    with GGUFReader(src) as a, GGUFReader(out) as b:
        for e in b.file.tensors:
            t = ggml.GGML_BY_ID.get(e.type_id)
            if t is None:
                continue
            x = a.load(e.name, "cpu").float()
            rows = x.numel() // e.ne[0]
            q = ggml.GGMLQuantized(t, tuple(x.shape), torch.frombuffer(b.raw(e.name), dtype=torch.uint8).reshape(rows, -1))
            d = ggml.dequantize(q).double() - x.double()
            errs[e.name] = {"type": t.name, "numel": x.numel(), "mse": float((d * d).mean())}
    return errs


# The quantizer's stages the profile times (module, function, stage), inner ones per chunk.
_INNER_STAGES = [
    ("quantd.engine.ggml.kquants", "_affine_weights", "k-quant weights (imatrix weighting included)"),
    ("quantd.engine.ggml.kquants", "affine_search", "k-quant scale search (make_qkx2_quants)"),
    ("quantd.engine.ggml.kquants", "symmetric_search", "k-quant scale search (make_qx_quants)"),
    ("quantd.engine.ggml.kquants", "q3_search", "k-quant scale search (make_q3_quants)"),
    ("quantd.engine.ggml.kquants", "qp_search", "k-quant sub-scale quantization (make_qp_quants)"),
    ("quantd.engine.ggml.kquants", "_affine_settle", "k-quant codes and super-scale refit"),
    ("quantd.engine.ggml.kquants", "_sym_settle", "k-quant codes and super-scale refit"),
]
# A super-block quantizer's time less the stages above: rounding the sub-scales against the super-scale and
# picking per super-block. A per-type quantizer's time less the super-block quantizer's: the bit packing into
# ggml's block bytes.
_BLOCK_FUNCS = ["_quantize_affine", "_quantize_symmetric"]
_TYPE_FUNCS = ["quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k"]


@contextlib.contextmanager
def profiled() -> Iterator[dict[str, float]]:
    """Wrap the pipeline's stages with timers for one run; yields seconds by stage."""
    import importlib

    from quantd.engine import ggml
    from quantd.engine.ggml import kquants, legacy
    from quantd.engine.ggml import stats as ggml_stats
    from quantd.io import gguf_file
    from quantd.io.outputs import gguf as gguf_out

    acc: dict[str, float] = {}
    lock = threading.Lock()
    undo: list[Callable[[], None]] = []

    def wrap(owner: Any, attr: str, stage: str | Callable[..., str]) -> None:
        fn = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                key = stage(*a, **k) if callable(stage) else stage
                with lock:
                    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)
        undo.append(lambda: setattr(owner, attr, fn))

    wrap(gguf_file.GGUFReader, "load", "read and convert the input")
    wrap(gguf_out, "_check_finite", "finite check")
    wrap(ggml, "quantize", lambda x, t, **k: f"quantize {t.name} (wall)")
    wrap(ggml_stats, "ggml_error_stats", "statistics (decode + moments)")
    wrap(gguf_file.GGUFWriter, "write", "write")
    wrap(gguf_file.GGUFWriter, "finish", "write")
    for mod, fn, stage in _INNER_STAGES:
        wrap(importlib.import_module(mod), fn, stage)
    for fn in _BLOCK_FUNCS:
        wrap(kquants, fn, "k-quant super-blocks (threads)")
    for fn in _TYPE_FUNCS:
        wrap(kquants, fn, f"{fn[9:]} total (threads)")
    for t in ggml.GGML_TYPES.values():  # the quantizers the traits table holds are the unwrapped ones
        if t.block_size == legacy.QK:
            wrap(legacy, f"quantize_{t.name}", f"{t.name} total (threads)")
    saved = dict(ggml.GGML_TYPES)
    for name, t in saved.items():
        kquant = t.block_size == kquants.QK_K
        fn = getattr(kquants if kquant else legacy, f"quantize_{name}")
        q = fn if kquant else (lambda f: (lambda x, imp: f(x)))(fn)  # the benchmark's mixes run without imatrix
        # the legacy types' fused quantizer stays the unwrapped one: the compiled kernels trace it
        ggml.GGML_TYPES[name] = dataclasses.replace(t, quantize_blocks=q)
    try:
        yield acc
    finally:
        ggml.GGML_TYPES.update(saved)
        for u in reversed(undo):
            u()


def _profile_rows(acc: dict[str, float]) -> dict[str, float]:
    """The stage seconds, with the k-quants' remainders split out: sub-scale rounding and picks (the super-block
    quantizers less their stages) and bit packing (the type quantizers less the super-block quantizers)."""
    out = dict(sorted(acc.items()))
    blocks = out.pop("k-quant super-blocks (threads)", None)
    if blocks is not None:
        inner = sum(v for k, v in acc.items() if k.startswith("k-quant") and "super-blocks" not in k)
        totals = sum(v for k, v in acc.items() if k.endswith("total (threads)") and "_k" in k)
        out["k-quant sub-scale rounding and per-block picks"] = max(blocks - inner, 0.0)
        out["k-quant bit packing"] = max(totals - blocks, 0.0)
    return {k: round(v, 4) for k, v in out.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _gguf_models import llama_quantize
    from quantd.io.pipeline import quantize_file
    from quantd_client import QuantConfig

    torch.set_num_threads(args.threads)
    private_inductor_cache()  # a cold build of the kernels, timed apart (kernel_warmup_s)
    tmp = Path(tempfile.mkdtemp(prefix="quantd-gguf-bench-"))
    src = write_model(tmp / "model-f32.gguf", embd=args.embd, ff=args.ff, layers=args.layers, vocab=args.vocab)
    from quantd.io.gguf_file import GGUFFile

    numel = sum(int(np.prod(t.ne)) for t in GGUFFile(src).tensors)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "model": {"embd": args.embd, "ff": args.ff, "layers": args.layers, "vocab": args.vocab, "params": numel,
                  "bytes": src.stat().st_size, "weights": "Student t (5 dof) / sqrt(fan_in·5/3)"},
        "threads": {"quantd_torch": args.threads, "llama_cpp": [1, args.threads]},
        "repeats": args.repeats,
        "mixes": [],
    }
    from quantd.engine.kernels import KERNELS

    def quantd(mix: str, dst: Path) -> float:
        t0 = time.perf_counter()
        quantize_file(src, dst, QuantConfig(output="gguf", gguf_mix=mix), device="cpu")  # type: ignore[arg-type]
        return time.perf_counter() - t0

    compiled = KERNELS.available()
    result["compiled_kernels"] = compiled
    if compiled:  # a server's GGUF warm-up: cold here, then a restarted server's on the cache it filled
        from torch._dynamo.utils import counters

        from quantd.io.outputs.gguf import warm_up_gguf

        result["kernel_warmup_s"] = warm_up_gguf()
        result["kernel_warmup_cached_s"] = float(subprocess.run(
            [sys.executable, "-c", "from quantd.io.outputs.gguf import warm_up_gguf; print(warm_up_gguf())"],
            check=True, capture_output=True, text=True).stdout.split()[-1])
        graphs = counters["stats"]["unique_graphs"]
        log(f"kernels built in {result['kernel_warmup_s']:.1f} s (cached: {result['kernel_warmup_cached_s']:.1f} s)")
    for mix in args.mixes:
        row: dict[str, Any] = {"mix": mix}
        ours = tmp / f"quantd-{mix}.gguf"
        row["quantd_s"] = min(quantd(mix, ours) for _ in range(args.repeats))
        KERNELS.reset(available=False)
        row["quantd_eager_s"] = min(quantd(mix, tmp / f"eager-{mix}.gguf") for _ in range(args.repeats))
        KERNELS.reset()
        with profiled() as acc:
            row["profile_run_s"] = quantd(mix, tmp / f"prof-{mix}.gguf")
        row["profile"] = _profile_rows(acc)
        log(f"{mix}: quantd {row['quantd_s']:.2f} s (eager {row['quantd_eager_s']:.2f} s)")
        for n in (1, args.threads):
            theirs = tmp / f"llama-{mix}-{n}.gguf"
            row[f"llama_cpp_{n}t_s"] = llama_quantize(src, theirs, FILE_TYPES[mix], nthread=n)
            log(f"{mix}: llama.cpp {n} thread(s) {row[f'llama_cpp_{n}t_s']:.1f} s")
        e_ours = tensor_errors(src, ours)
        e_eager = tensor_errors(src, tmp / f"eager-{mix}.gguf")
        e_theirs = tensor_errors(src, tmp / f"llama-{mix}-1.gguf")
        tensors = []
        for name, eo in e_ours.items():
            et = e_theirs[name]
            tensors.append({"name": name, "type": eo["type"], "llama_type": et["type"], "numel": eo["numel"],
                            "quantd_mse": eo["mse"], "llama_mse": et["mse"],
                            "ratio": eo["mse"] / et["mse"] if et["mse"] else 1.0})
        row["tensors"] = tensors
        row["eager_worst_ratio"] = max(e_eager[t["name"]]["mse"] / t["llama_mse"] if t["llama_mse"] else 1.0
                                       for t in tensors)
        row["tensors_no_worse"] = sum(t["ratio"] <= 1.0 for t in tensors)
        row["tensors_total"] = len(tensors)
        row["worst_ratio"] = max(t["ratio"] for t in tensors)
        row["numel_weighted_mse_ratio"] = (sum(t["quantd_mse"] * t["numel"] for t in tensors)
                                           / sum(t["llama_mse"] * t["numel"] for t in tensors))
        for n in (1, args.threads):
            row[f"speedup_vs_llama_{n}t"] = row[f"llama_cpp_{n}t_s"] / row["quantd_s"]
            row[f"eager_speedup_vs_llama_{n}t"] = row[f"llama_cpp_{n}t_s"] / row["quantd_eager_s"]
        log(f"{mix}: no worse on {row['tensors_no_worse']}/{row['tensors_total']} tensors, worst ratio "
            f"{row['worst_ratio']:.4f}, speed x{row['speedup_vs_llama_1t']:.2f} (1 thread)")
        result["mixes"].append(row)
        if compiled:
            result["graphs_compiled_after_warmup"] = counters["stats"]["unique_graphs"] - graphs
        write_results(args.out, result)
        for p in tmp.glob(f"*-{mix}*.gguf"):
            p.unlink()
    src.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mixes", nargs="+", default=list(FILE_TYPES), choices=list(FILE_TYPES))
    ap.add_argument("--repeats", type=int, default=2, help="timed quantd runs per mix and path (the fastest kept)")
    ap.add_argument("--out", default="gguf.json")
    args = ap.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
