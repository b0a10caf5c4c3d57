"""File-level pipelines: quantize a model file into an artifact, analyze schemes, calibrate activations.

One tensor at a time: load to the device, check, quantize, measure, write, free. Every output
tensor is planned (and every config checked against every tensor) before any work starts, so a
config that cannot apply fails in milliseconds with a ConfigError naming the field and tensor.
Device errors (``torch.cuda.OutOfMemoryError`` included) propagate as they are: the jobs layer
decides what to do with them.

Summary conventions: ``input_bytes``/``output_bytes`` are the sizes of the input file and of the
artifact file (as ``Job.input.bytes`` and ``Job.result.artifact_bytes``), so ``compression_ratio``
is what a user saves on disk; each tensor's own ``compression_ratio`` compares its bits per weight.
``bits_per_weight`` is the numel-weighted mean over quantized tensors (the input's own bits when
nothing is quantized). The artifact's metadata carries each quantized tensor's ErrorStats too.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError, JobCancelled, MalformedInputError, NonFiniteError, naming
from quantd_client import (
    AnalyzeResponse,
    AnalyzeResult,
    AnalyzeTensor,
    CalibrateResponse,
    ErrorStats,
    LayerCalibration,
    ObserverSpec,
    Progress,
    QuantConfig,
    Report,
    Scheme,
    Summary,
    TensorAnalyses,
    TensorReport,
)

from .artifact import encode_quantized, quantized_layout
from .calibration import CalibrationEntry, MethodCalibration, check_against, uses_calibrated_method
from .formats import QUANTIZABLE, torch_dtype
from .outputs import ModelStructure, OutputFormat, PlannedTensor, Sink, get_format
from .readers import ModelReader, TensorInfo, open_model

if TYPE_CHECKING:
    from quantd.engine.methods import LayerHessian

ProgressCallback = Callable[[Progress], None]


# One tensor's plan: its scheme (None: left as it is, with ``reason``) and the output tensors it becomes.
TensorPlan = PlannedTensor


def plan(tensors: list[TensorInfo], config: QuantConfig,
         calibration: Mapping[str, CalibrationEntry] | None = None, *, structure: ModelStructure | None = None,
         folded: Collection[str] = frozenset()) -> list[TensorPlan]:
    """The plan of every tensor, in file order, for the output format ``config.output``. Raises
    ConfigError (field + tensor) when a scheme cannot apply to a tensor's shape (its method included:
    arguments, supported schemes, calibration — ``calibration`` is the index of the job's calibration file,
    None without one), when the format cannot hold it, or when an output name would collide with another
    tensor. ``folded``: weights whose AWQ scales model-aware calibration folds into the model (their result
    has no ``channel_scale``)."""
    if config.output == "gguf":  # the GGUF format plans with llama.cpp's mixes
        from .outputs.gguf import plan_gguf

        return plan_gguf(tensors, config)
    from quantd.engine.methods import check_method

    fmt = get_format(config.output)
    known = structure or ModelStructure()
    plans: list[TensorPlan] = []
    for t in tensors:
        dt = torch_dtype(t.dtype)
        scheme: Scheme | None
        reason: str | None
        if dt not in QUANTIZABLE:
            scheme, reason = None, f"{t.dtype} tensor passes through"
        elif math.prod(t.shape) == 0:
            scheme, reason = None, "empty tensor"
        else:
            scheme, reason = config.scheme_for(t.name, t.shape)
        scheme, reason = fmt.select(t, scheme, reason, known)
        if scheme is None:
            outputs = tuple(fmt.passthrough(t))
        else:
            has_calibration = calibration is not None and check_against(dict(calibration), t.name, t.shape)
            check_method(t.shape, scheme, name=t.name, has_calibration=has_calibration)
            stored = scheme.model_copy(update={"method": "rtn", "method_args": {}}) if t.name in folded else scheme
            fmt.check(t.name, t.shape, stored)
            outputs = tuple(fmt.layout(t.name, t.shape, stored))
        plans.append(TensorPlan(t, scheme, reason, outputs))
    owner: dict[str, str] = {}
    for p in plans:
        for o in p.outputs:
            if o.name in owner:
                raise ConfigError(f"artifact tensor {o.name!r} would be written by both {owner[o.name]!r} "
                                  f"and {p.info.name!r}; skip one with a rule", tensor=p.info.name, field="rules")
            owner[o.name] = p.info.name
    return plans


def check_finite(x: torch.Tensor, name: str) -> None:
    """NonFiniteError naming the tensor when a float tensor holds NaN or Inf."""
    if x.is_floating_point():
        bad = int((~torch.isfinite(x)).sum().item())
        if bad:
            raise NonFiniteError(f"tensor {name!r}: {bad} of {x.numel()} values are NaN or Inf", tensor=name)


def check_finite_quickly(x: torch.Tensor, name: str) -> None:
    """:func:`check_finite` for a tensor that is almost always finite: a NaN or an infinity makes the float32
    sum NaN or infinite, so one vectorised reduction clears a finite tensor; only a non-finite sum (bad values,
    or finite ones whose sum overflows) takes the counting check. Tensors of other dtypes pass."""
    if x.dtype in QUANTIZABLE and not bool(torch.isfinite(x.sum(dtype=torch.float32))):
        check_finite(x, name)


def _measure(x: torch.Tensor, scheme: Scheme, name: str, calibration: LayerHessian | None = None
             ) -> tuple[ErrorStats, QuantizedTensor]:
    """Quantize with the scheme's method and measure; with calibration, ``output_rel_error`` too."""
    from quantd.engine.methods import output_rel_error, quantize_tensor
    from quantd.engine.stats import quantized_error_stats

    qt = quantize_tensor(x, scheme, name=name, calibration=calibration)
    stats = quantized_error_stats(x, qt)
    if calibration is not None:
        stats = stats.model_copy(update={"output_rel_error": output_rel_error(x, qt, calibration.hessian)})
    return stats, qt


def _is_ggml(scheme: Scheme) -> bool:
    from quantd_client import DTYPES

    return DTYPES[scheme.dtype].kind == "ggml"


def _ggml_stats(x: torch.Tensor, scheme: Scheme, name: str) -> ErrorStats:
    """The statistics of ``x`` quantized to the ggml type ``scheme.dtype`` (``/v1/analyze`` of ggml types)."""
    from quantd.engine import ggml
    from quantd.engine.ggml.stats import ggml_error_stats

    return ggml_error_stats(x, ggml.quantize(x, ggml.GGML_TYPES[scheme.dtype], name=name),
                            in_bits=x.element_size() * 8, name=name)


def _process(reader: ModelReader, writer: Sink, fmt: OutputFormat, p: TensorPlan, device: torch.device,
             calibration: MethodCalibration | None = None) -> TensorReport:
    name = p.info.name
    shape, in_dtype = list(p.info.shape), p.info.dtype
    # load_transient: x may share the reader's buffer, so nothing derived from it outlives this call
    # (everything is written before the next tensor is read).
    if p.scheme is None:  # kept as it is: no trip through the device
        kept = reader.load_transient(name, "cpu")
        check_finite_quickly(kept, name)  # CONTRACT §2: NaN/Inf weights are refused, kept ones too
        writer.write(name, kept)
        return TensorReport(name=name, shape=shape, in_dtype=in_dtype, scheme=None, stats=None, skipped=True,
                            reason=p.reason)
    layer = calibration.layer(name, device) if calibration is not None else None
    x = reader.load_transient(name, device)
    try:  # the engine refuses NaN/Inf on its own (observing the range), without an extra pass here
        stats, qt = _measure(x, p.scheme, name, layer)
    except NonFiniteError:
        check_finite(x, name)  # the error with a count of the bad values
        raise
    stats = write_encoded(fmt, writer, qt, name, stats)
    return TensorReport(name=name, shape=shape, in_dtype=in_dtype, scheme=p.scheme, stats=stats, skipped=False)


def write_encoded(fmt: OutputFormat, sink: Sink, qt: QuantizedTensor, name: str, stats: ErrorStats) -> ErrorStats:
    """``qt`` written through ``fmt``'s encoding; ``stats`` with the bits per weight that encoding stored where
    the format counts its own (``bits_from_encoding``)."""
    stored = 0
    for out_name, t in fmt.encode(qt, name).items():
        sink.write(out_name, t)
        stored += t.numel() * t.element_size() * 8
    if fmt.bits_from_encoding:
        stats = stats.model_copy(update={"bits_per_weight": stored / max(1, stats.numel)})
    return stats


def summarize(plans: list[TensorPlan], reports: list[TensorReport], input_bytes: int, output_bytes: int,
              elapsed_s: float, device: torch.device) -> Summary:
    """The CONTRACT §4 summary of a finished quantization."""
    quantized = [(p, r) for p, r in zip(plans, reports, strict=True) if r.stats is not None]
    qnumel = sum(p.numel for p, _ in quantized)
    if qnumel:
        bpw = sum(p.numel * r.stats.bits_per_weight for p, r in quantized if r.stats) / qnumel
    else:
        numel = sum(p.numel for p in plans)
        # every dtype the readers pass through (float8, uint16, ...), not only those of the wire schemas
        bpw = sum(p.numel * torch_dtype(p.info.dtype).itemsize * 8 for p in plans) / numel if numel else 0.0
    sqnrs = [(r.stats.sqnr_db, r.name) for _, r in quantized
             if r.stats and r.stats.sqnr_db is not None and math.isfinite(r.stats.sqnr_db)]
    worst = min(sqnrs) if sqnrs else None
    return Summary(
        tensors_quantized=len(quantized), tensors_skipped=len(plans) - len(quantized),
        input_bytes=input_bytes, output_bytes=output_bytes,
        compression_ratio=input_bytes / output_bytes if output_bytes else 1.0,
        bits_per_weight=bpw,
        mean_sqnr_db=sum(s for s, _ in sqnrs) / len(sqnrs) if sqnrs else None,
        min_sqnr_db=worst[0] if worst else None, worst_tensor=worst[1] if worst else None,
        elapsed_s=elapsed_s, device=str(device),
    )


def quantize_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], config: QuantConfig, *,
                  device: str | torch.device, filename: str | None = None, job_id: str | None = None,
                  on_progress: ProgressCallback | None = None,
                  should_cancel: Callable[[], bool] | None = None,
                  calibration: str | os.PathLike[str] | None = None, max_total_bytes: int | None = None) -> Report:
    """Quantize the model file ``src`` into the artifact ``dst`` (CONTRACT §5) and return the Report.

    ``on_progress`` is called once before the first tensor and after every tensor;
    ``should_cancel`` is polled between tensors (JobCancelled; no artifact is left behind).
    ``calibration``: activation samples (name → ``[N, ...]``) observed with ``config.activations``;
    the ranges go into the report and the artifact's metadata (``"activations"``).
    ``max_total_bytes``: a bound on the input's tensors once loaded (an npz inflated; see :func:`open_model`).
    """
    started = time.perf_counter()
    activations = None
    importance = None
    with contextlib.ExitStack() as stack:
        method_cal = None
        if calibration is not None and config.output == "gguf":  # a llama.cpp importance matrix
            from .imatrix import load_imatrix

            importance = load_imatrix(calibration)
        elif calibration is not None:  # first: a bad calibration file fails before any weight work
            method_cal = stack.enter_context(MethodCalibration(calibration))
            # Activation samples as in v1, unless the file serves the calibrated methods (Hessians, or a
            # config naming gptq/awq): then only when config.activations asks for them.
            if config.activations is not None or not (method_cal.has_hessians or uses_calibrated_method(config)):
                spec = config.activations or ObserverSpec()
                activations = calibrate_file(calibration, spec, device=device).layers
        reader = stack.enter_context(open_model(src, filename, max_total_bytes=max_total_bytes))
        return quantize_model(reader, dst, config, device=device, input_bytes=lambda: os.path.getsize(src),
                              job_id=job_id, on_progress=on_progress, should_cancel=should_cancel,
                              activations=activations, started=started, importance=importance,
                              calibration=method_cal)


def quantize_model(reader: ModelReader, dst: str | os.PathLike[str], config: QuantConfig, *,
                   device: str | torch.device, input_bytes: Callable[[], int], job_id: str | None = None,
                   on_progress: ProgressCallback | None = None,
                   should_cancel: Callable[[], bool] | None = None,
                   activations: Sequence[LayerCalibration] | None = None,
                   started: float | None = None,
                   importance: Mapping[str, torch.Tensor] | None = None,
                   calibration: MethodCalibration | None = None) -> Report:
    """:func:`quantize_file` on an open reader, tensor by tensor in the reader's order.
    ``input_bytes()`` is asked for the input's size once every tensor is written (the summary's
    ``input_bytes``); ``started`` is the ``perf_counter`` the summary's ``elapsed_s`` counts from.
    ``calibration``: the layers' inputs for the calibrated methods (and every tensor's ``output_rel_error``)."""
    t0 = time.perf_counter() if started is None else started
    dev = torch.device(device)
    if config.output == "gguf":  # llama.cpp's format: ggml block types, the input's metadata kept
        from .outputs.gguf import quantize_gguf

        return quantize_gguf(reader, dst, config, device=dev, input_bytes=input_bytes, job_id=job_id,
                             on_progress=on_progress, should_cancel=should_cancel, started=t0,
                             importance=importance)
    fmt = get_format(config.output)
    plans = plan(reader.tensors, config, None if calibration is None else calibration.index)
    progress = Progress(tensors_total=len(plans), bytes_total=sum(p.info.nbytes for p in plans))
    if on_progress is not None:
        on_progress(progress)
    reports: list[TensorReport] = []
    extra = None if activations is None else {"activations": [a.model_dump(mode="json") for a in activations]}
    with fmt.open_sink(dst, plans, extra_meta=extra) as writer:
        for p in plans:
            if should_cancel is not None and should_cancel():
                raise JobCancelled(f"cancelled after {len(reports)} of {len(plans)} tensors")
            reports.append(_process(reader, writer, fmt, p, dev, calibration))
            done = progress.bytes_done + p.info.nbytes
            progress = Progress(tensors_done=len(reports), tensors_total=len(plans), bytes_done=done,
                                bytes_total=progress.bytes_total,
                                fraction=done / progress.bytes_total if progress.bytes_total
                                else len(reports) / len(plans))
            if on_progress is not None:
                on_progress(progress)
        summary = summarize(plans, reports, input_bytes(), writer.total_bytes, time.perf_counter() - t0, dev)
        writer.finish(summary.model_dump(mode="json"),
                      {r.name: r.stats.model_dump(mode="json") for r in reports if r.stats is not None})
    return Report(job_id=job_id, config=config, summary=summary, tensors=reports,
                  activations=None if activations is None else list(activations))


# The schemes whose kernels a server compiles at start (quantd serve / quantd worker, QUANTD_WARMUP).
WARMUP_SCHEMES = (
    Scheme(dtype="int8", symmetric=True, granularity="channel"),
    Scheme(dtype="int4", symmetric=False, granularity="group", group_size=128),
    Scheme(dtype="int4", symmetric=True, granularity="group", group_size=128),
    # QLoRA's default, so that the first nf4 tensor does not wait for its kernels to compile.
    Scheme(dtype="nf4", granularity="group", group_size=64),
    # hqq's search is one compiled kernel per dtype and setting: its defaults at int4 (any group size).
    Scheme(dtype="int4", symmetric=False, granularity="group", group_size=64, method="hqq"),
)


def warm_up(schemes: Sequence[Scheme] = WARMUP_SCHEMES, devices: Sequence[str] = ("cpu",)) -> float | None:
    """Run one tensor's pipeline (quantize, statistics, packing) per scheme on small tensors on each of
    ``devices`` whose compiled kernels are on (the workers' devices: a CUDA device's kernels are its own), so
    that the compiled kernels those schemes need are built (or loaded from Inductor's disk cache) before the
    first real tensor. Seconds taken, or None when no device's compiled kernels are on (nothing to warm)."""
    from quantd.engine import kernels

    targets = [torch.device(d) for d in dict.fromkeys(devices)]
    targets = [d for d in targets if (kernels.KERNELS.available_cuda() if d.type == "cuda"
                                      else kernels.KERNELS.available())]
    if not targets:
        return None
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    # Two weights, so that a kernel is built in both the variants Inductor makes of it: up to 4096 blocks
    # (serial loops) and more (parallel). The small one is just large enough to take the compiled path, in whole
    # groups of up to 256; the large one has more than 4096 rows (per-channel blocks). Neither is square:
    # Dynamo would take two equal sizes for one (its "duck sizing") and build kernels for square weights only,
    # so that the first weight of another shape would compile them again, inside its job.
    cols = 1024
    rows = max(1, -(-max(kernels.MIN_ELEMENTS, 1) // cols))
    for host in (torch.randn(rows, cols, generator=g), torch.randn(4352, 256, generator=g)):
        for device in targets:
            x = host.to(device)
            for scheme in schemes:
                _, qt = _measure(x, scheme, "warm-up")
                encode_quantized(qt, "warm-up")
    return time.perf_counter() - t0


def run_analyses(x: torch.Tensor, scheme: Scheme, names: Sequence[str], tensor: str) -> TensorAnalyses:
    """The named analyses (bit-width comparison, outlier impact, scale sensitivity) of one tensor."""
    from quantd.engine import analysis

    out = TensorAnalyses()
    if "bit_widths" in names:
        out.bit_widths = analysis.compare_bit_widths(x, scheme, name=tensor)
    if "outlier_impact" in names:
        out.outlier_impact = analysis.outlier_impact(x, scheme, name=tensor)
    if "scale_sensitivity" in names:
        out.scale_sensitivity = analysis.scale_sensitivity(x, scheme, name=tensor)
    return out


def _analyzable(t: TensorInfo, min_dims: int) -> bool:
    return torch_dtype(t.dtype) in QUANTIZABLE and len(t.shape) >= min_dims and math.prod(t.shape) > 0


def analyze_file(src: str | os.PathLike[str], schemes: list[Scheme], *, device: str | torch.device,
                 filename: str | None = None, analyses: Sequence[str] = (),
                 max_total_bytes: int | None = None) -> AnalyzeResponse:
    """Error statistics of every scheme (in order) on every float tensor with ≥ 2 dims; no artifact.

    1-D tensors (biases, norms) and integer tensors are left out, as ``skip_1d`` does by default, unless
    the file has no float tensor of ≥ 2 dims: then its 1-D ones are analyzed (a lone vector gets its
    statistics, not an empty answer). Every scheme is checked against every tensor first (ConfigError
    naming both). ``max_total_bytes``: as :func:`quantize_file`'s."""
    from quantd.engine.methods import check_method

    dev = torch.device(device)
    out: list[AnalyzeTensor] = []
    with open_model(src, filename, max_total_bytes=max_total_bytes) as reader:
        targets = ([t for t in reader.tensors if _analyzable(t, 2)]
                   or [t for t in reader.tensors if _analyzable(t, 1)])
        for t in targets:
            for i, s in enumerate(schemes):
                with naming(f"configs[{i}]"):
                    if _is_ggml(s):  # ggml's blocks run along rows
                        from quantd.engine import ggml

                        ggml.check_shape(ggml.GGML_TYPES[s.dtype], t.shape, name=t.name)
                    else:
                        check_method(t.shape, s, name=t.name, has_calibration=False)
                        quantized_layout(t.name, t.shape, s)
        if analyses and _is_ggml(schemes[0]):
            raise ConfigError("analyses run on an integer, nf4 or float scheme; configs[0] is a ggml block type",
                              field="analyses")
        for t in targets:
            x = reader.load(t.name, dev)
            results = []
            for i, s in enumerate(schemes):
                try:
                    with naming(f"configs[{i}]"):
                        stats = _ggml_stats(x, s, t.name) if _is_ggml(s) else _measure(x, s, t.name)[0]
                        results.append(AnalyzeResult(scheme=s, stats=stats))
                except NonFiniteError:
                    check_finite(x, t.name)
                    raise
            with naming("analyses (of configs[0])"):
                extra = run_analyses(x, schemes[0], analyses, t.name) if analyses else None
            out.append(AnalyzeTensor(name=t.name, shape=list(t.shape), results=results, analyses=extra))
            del x
    return AnalyzeResponse(tensors=out)


def calibrate_file(src: str | os.PathLike[str], spec: ObserverSpec, *, device: str | torch.device,
                   filename: str | None = None, max_total_bytes: int | None = None) -> CalibrateResponse:
    """Static activation ranges from a samples file (name → ``[N, ...]`` float activations).
    ``max_total_bytes``: as :func:`quantize_file`'s."""
    from quantd.engine.calibration import calibrate_layers

    dev = torch.device(device)
    with open_model(src, filename, max_total_bytes=max_total_bytes) as reader:
        for t in reader.tensors:
            if torch_dtype(t.dtype) not in QUANTIZABLE or len(t.shape) < 1 or math.prod(t.shape) == 0:
                raise MalformedInputError(
                    f"tensor {t.name!r}: activation samples must be non-empty float tensors [N, ...], got "
                    f"{t.dtype} {list(t.shape)}", tensor=t.name)

        def samples() -> Iterator[tuple[str, torch.Tensor]]:
            for t in reader.tensors:
                x = reader.load(t.name, dev)
                check_finite(x, t.name)
                yield t.name, x

        layers = calibrate_layers(samples(), spec)
    return CalibrateResponse(layers=list(layers))
