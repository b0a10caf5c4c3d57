"""``output: "gguf"``: llama.cpp's GGUF, from a GGUF input (CONTRACT §9.2).

Every metadata pair of the input is kept byte for byte (``general.file_type`` set to the mix,
``general.quantization_version`` to ggml's 2), tensors stay in input order, and each tensor is either
quantized to a ggml block type (``scheme.dtype`` ``q4_k`` …, a rule's, or the ``gguf_mix``'s choice),
converted to float16/bfloat16, or copied as it is. The file streams: the header is written from the plan,
then one tensor at a time, so memory follows the largest tensor. With a llama.cpp importance matrix as the
calibration file, each tensor's entry weights its k-quant search.
"""

from __future__ import annotations

import fnmatch
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantd.errors import ConfigError, JobCancelled, MalformedInputError, QuantdError
from quantd_client import DTYPES, Progress, QuantConfig, Report, Scheme, TensorReport

from ..artifact import OutputTensor
from ..gguf_file import FLOAT_TYPES, TYPE_OF_DTYPE, GGUFReader, GGUFWriter, OutTensor, tensor_nbytes
from ..gguf_mix import FILE_TYPES, ModelParams, fallback, ggml_n_dims, mix_types, weights_order
from ..readers import ModelReader, TensorInfo
from . import register
from .base import OutputFormat, PlannedTensor, Sink

if TYPE_CHECKING:
    from quantd.engine.types import QuantizedTensor

# general.file_type of a file whose quantized tensors are mostly one type (llama_ftype's "mostly" values).
_FILE_TYPE_OF: dict[str, int] = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 11,
                                 "q4_k": 14, "q5_k": 16, "q6_k": 18, "float16": 1, "bfloat16": 32}
_FLOAT_TARGETS: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
U32 = 4


def _check_dtype(name: str, dtype: str) -> None:
    if DTYPES[dtype].kind != "ggml" and dtype not in _FLOAT_TARGETS:
        raise ConfigError(f"GGUF holds ggml block types (q8_0, q4_k, ...), float16 and bfloat16, not {dtype}; "
                          f"choose a ggml dtype or a gguf_mix", field="scheme.dtype", tensor=name)


def _params(tensors: Sequence[TensorInfo], metadata: Mapping[str, Any] | None) -> ModelParams:
    """The hyper-parameters the mixes use, from the GGUF metadata (``{arch}.block_count`` …), or — for an
    early check without the file's metadata — from the tensor names."""
    meta = metadata or {}
    arch = str(meta.get("general.architecture", ""))

    def num(key: str, default: int) -> int:
        v = meta.get(f"{arch}.{key}", default)  # per-layer arrays come as their first (layer 0's) value
        if isinstance(v, float) and not math.isfinite(v):
            return default  # a hostile file's NaN or Inf: the default, as for a missing key
        return int(v) if isinstance(v, int | float) else default

    layers = {n for n, _ in map(weights_order, (t.name for t in tensors)) if n >= 0}
    n_head = num("attention.head_count", 0)
    return ModelParams(arch=arch, n_layer=num("block_count", max(layers) + 1 if layers else 0), n_head=n_head,
                       n_head_kv=num("attention.head_count_kv", n_head), n_expert=num("expert_count", 0))


def plan_gguf(tensors: Sequence[TensorInfo], config: QuantConfig, *, metadata: Mapping[str, Any] | None = None,
              has_imatrix: bool = False) -> list[PlannedTensor]:
    """Each tensor's target: a rule's scheme (first match wins, as everywhere), else the ``gguf_mix``'s
    type (llama.cpp keeps norms, 1-D and the other tensors it never quantizes as they are), else the default
    scheme under ``skip_1d``/``min_numel``; 1-D tensors stay as they are whatever a rule says (llama.cpp's
    norm and add ops take them in float: a quantized or float16 norm aborts it). A ggml type whose block does not divide a row falls back as
    llama.cpp's does. ConfigError names the tensor when a dtype cannot be held by GGUF."""
    if config.gguf_mix and config.scheme.method != "rtn":  # the mix stands in for the scheme: said, not dropped
        raise ConfigError(f"method {config.scheme.method!r} cannot go with gguf_mix {config.gguf_mix!r}: the mix picks "
                          "llama.cpp's round-to-nearest block types (use method 'rtn', or leave it out)",
                          field="scheme.method")
    floats = [t for t in tensors if t.dtype in ("float32", "float16", "bfloat16")]
    mix = (mix_types(config.gguf_mix, [(t.name, t.shape) for t in floats], _params(tensors, metadata),
                     has_imatrix=has_imatrix) if config.gguf_mix else {})
    plans: list[PlannedTensor] = []
    for t in tensors:
        scheme: Scheme | None = None
        reason: str | None = None
        numel = math.prod(t.shape)
        rule = next((r for r in config.rules if fnmatch.fnmatchcase(t.name, r.match)), None)
        if t.dtype not in ("float32", "float16", "bfloat16"):
            reason = f"{t.dtype} tensor passes through"
        elif rule is not None or not config.gguf_mix:
            scheme, reason = config.scheme_for(t.name, t.shape)
        elif numel < config.min_numel:  # as for every config (CONTRACT §1), the mix's choice included
            reason = f"numel {numel} < min_numel {config.min_numel}"
        elif t.name in mix:
            scheme = Scheme(dtype=mix[t.name])
        else:
            reason = f"{config.gguf_mix} keeps this tensor as it is (llama.cpp quantizes 2-D weights but norms)"
        if scheme is not None and numel:
            _check_dtype(t.name, scheme.dtype)
            if scheme.method != "rtn":  # ggml's blocks are its own rounding; nothing else could be stored
                raise ConfigError(f"method {scheme.method!r} cannot be held by GGUF output (its types are "
                                  "llama.cpp's round-to-nearest blocks): use method 'rtn'",
                                  tensor=t.name, field="scheme.method")
        if scheme is not None and ggml_n_dims(t.shape) == 1:  # valid, but llama.cpp's ops take them in float
            scheme, reason = None, "1-D: llama.cpp keeps norms and other 1-D tensors as they are"
        if scheme is not None and numel:
            if DTYPES[scheme.dtype].kind == "ggml":
                target = fallback(scheme.dtype, t.shape[-1])
                if target != scheme.dtype:
                    reason = f"rows of {t.shape[-1]} are not whole {scheme.dtype} blocks: {target} (llama.cpp's fallback)"
                    scheme = Scheme(dtype=target)
        elif numel == 0:
            scheme, reason = None, "empty tensor"
        dtype = "U8" if scheme is not None and DTYPES[scheme.dtype].kind == "ggml" else (
            "F16" if scheme is not None and scheme.dtype == "float16" else
            "BF16" if scheme is not None else {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(t.dtype, "U8"))
        plans.append(PlannedTensor(t, scheme, reason, (OutputTensor(t.name, dtype, t.shape),)))
    return plans


def plan_file(reader: GGUFReader, config: QuantConfig, *, has_imatrix: bool = False) -> list[PlannedTensor]:
    """:func:`plan_gguf` of a GGUF file's tensors, with its metadata (the mixes read the architecture's)."""
    return plan_gguf(reader.tensors, config, metadata={kv.key: kv.first for kv in reader.file.metadata},
                     has_imatrix=has_imatrix)


def _type_id(scheme: Scheme) -> int:
    from quantd.engine.ggml import GGML_TYPES

    if scheme.dtype in _FLOAT_TARGETS:
        return TYPE_OF_DTYPE[_FLOAT_TARGETS[scheme.dtype]]
    return GGML_TYPES[scheme.dtype].type_id


def _file_type(config: QuantConfig, plans: Sequence[PlannedTensor]) -> int:
    if config.gguf_mix:
        return FILE_TYPES[config.gguf_mix]
    counts: dict[str, int] = {}
    for p in plans:
        if p.scheme is not None:
            counts[p.scheme.dtype] = counts.get(p.scheme.dtype, 0) + p.numel
    return _FILE_TYPE_OF[max(counts, key=lambda k: counts[k])] if counts else 0


def _importance(table: Mapping[str, torch.Tensor] | None, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    if not table or name not in table:
        return None
    imp = table[name]
    n = shape[-1]
    if len(shape) == 3 and imp.shape[0] == 1 and imp.shape[-1] == shape[0] * n:
        imp = imp.reshape(shape[0], n)  # the legacy .dat stores stacked experts' values as one flat list
    if imp.shape[-1] != n or (imp.shape[0] > 1 and (len(shape) != 3 or shape[0] != imp.shape[0])):
        if name in ("token_embd.weight", "per_layer_token_embd.weight"):
            return None  # llama.cpp ignores the embedding's entry too (its input is not a matmul's)
        raise MalformedInputError(f"importance matrix entry {name!r} has shape {list(imp.shape)}; the tensor is "
                                  f"{list(shape)}", tensor=name, field="calibration")
    return imp


def check_importance(plans: Sequence[PlannedTensor], table: Mapping[str, torch.Tensor]) -> None:
    """MalformedInputError naming the tensor when an importance matrix entry does not fit the tensor it is for
    (what the quantization would raise on reaching it), or when the matrix names none of the tensors the job
    quantizes (another model's, which would change nothing): a job is refused before it is accepted."""
    quantized = [p for p in plans if p.scheme is not None]
    for p in quantized:
        _importance(table, p.info.name, p.info.shape)
    # llama-imatrix records the inputs of the blocks' matmuls (blk.*): never the embeddings', the output
    # head's only when asked
    recorded = [p for p in quantized if p.info.name.startswith("blk.")]
    if table and recorded and not any(p.info.name in table for p in recorded):
        some = ", ".join(repr(k) for k in sorted(table)[:3])
        raise MalformedInputError(f"the importance matrix has no entry for any tensor this job quantizes (it names "
                                  f"{len(table)} tensors, such as {some}): is it for another model?",
                                  field="calibration")


def _quantize_one(x: torch.Tensor, scheme: Scheme, name: str, imp: torch.Tensor | None, in_bits: int
                  ) -> tuple[Any, torch.Tensor]:
    from quantd.engine import ggml
    from quantd.engine.ggml.stats import ggml_error_stats

    from ..pipeline import _measure

    if scheme.dtype in _FLOAT_TARGETS:
        stats, qt = _measure(x, scheme, name)
        return stats, qt.codes
    t = ggml.GGML_TYPES[scheme.dtype]
    x = x.float()  # float16/bfloat16 inputs converted once, for the search and the statistics
    if imp is not None and imp.shape[0] > 1:  # stacked experts: each with its own importance
        parts = [ggml.quantize(x[e], t, importance=imp[e], name=name).data for e in range(x.shape[0])]
        q = ggml.GGMLQuantized(t, tuple(x.shape), torch.cat(parts))
    else:
        q = ggml.quantize(x, t, importance=None if imp is None else imp[0], name=name)
    return ggml_error_stats(x, q, in_bits=in_bits, name=name), q.data


# The warm-up's weights (rows, row length), the largest first: Inductor fixes a kernel's code (its tiling and
# vectorisation) from the sizes of its first call, and kernels first built on a few super-blocks ran a model's
# tensors about 20 % slower. The second is exactly one statistics chunk (its size-1 dim is a variant of its own),
# the third a few dozen super-blocks.
WARM_UP_SHAPES = ((1536, 1024), (256, 1024), (12, 1024))


def warm_up_gguf() -> float | None:
    """Build the ggml types' compiled kernels (or load them from Inductor's disk cache): every k-quant type's, with
    and without an importance matrix, the legacy types' and the GGUF statistics', on the non-square weights of
    :data:`WARM_UP_SHAPES` (no kernel specialised to square sizes). After it, a model's tensors of any shape find
    their kernels built (``bench/gguf_vs_llamacpp.py`` counts the graphs its timed runs still compile). From its
    end, under ``QUANTD_COMPILE=auto``, GGUF jobs in this process take the compiled path. Seconds taken, or None
    when the compiled kernels are off."""
    from quantd.engine import kernels
    from quantd.engine.ggml import GGML_TYPES
    from quantd.engine.ggml._common import building_kernels

    if not kernels.KERNELS.available():
        return None
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    with building_kernels():
        for x in (torch.randn(shape, generator=g) for shape in WARM_UP_SHAPES):
            imp = torch.rand(1, x.shape[1], generator=g) + 0.5
            for t in GGML_TYPES.values():  # the k-quants with and without an importance matrix
                for importance in (None, imp) if t.uses_importance else (None,):
                    _quantize_one(x, Scheme(dtype=t.name), "warm-up", importance, 32)  # type: ignore[arg-type]
    return time.perf_counter() - t0


def ggml_weights(path: str | os.PathLike[str], config: QuantConfig) -> int:
    """How many weights of the GGUF file at ``path`` ``config`` quantizes to ggml block types, from its header
    and the plan alone (no tensor is read); 0 for a file that is not a GGUF model or a config it refuses
    (the run itself then says why)."""
    from ..formats import detect_format

    try:
        if detect_format(Path(path)) != "gguf":
            return 0
        reader = GGUFReader(Path(path))
    except (OSError, QuantdError):
        return 0
    try:
        plans = plan_file(reader, config)
    except QuantdError:
        return 0
    finally:
        reader.close()
    return sum(math.prod(p.info.shape) for p in plans
               if p.scheme is not None and DTYPES[p.scheme.dtype].kind == "ggml")


def _not_gguf(fmt: str) -> ConfigError:
    return ConfigError(f'output "gguf" needs a GGUF input (as llama.cpp\'s convert_hf_to_gguf.py writes): a {fmt} '
                       'file has no architecture or tokenizer metadata for llama.cpp', field="output")


def gguf_input(reader: ModelReader) -> GGUFReader:
    """``reader`` when it reads a GGUF file; ConfigError (field ``output``) for any other input: llama.cpp's
    format is written from a GGUF model's own metadata. The quantization and the job submission both ask."""
    if not isinstance(reader, GGUFReader):
        raise _not_gguf(reader.format)
    return reader


def check_format(fmt: str, config: QuantConfig) -> None:
    """A job's input format (``reader.format``, or a sampled source's) checked against its config's output
    before the job is accepted: ``output: "gguf"`` (``gguf_mix`` included) needs a GGUF file."""
    if config.output == GGUFOutput.name and fmt != "gguf":
        raise _not_gguf(fmt)


def quantize_gguf(reader: ModelReader, dst: str | os.PathLike[str], config: QuantConfig, *,
                  device: torch.device, input_bytes: Callable[[], int], job_id: str | None = None,
                  on_progress: Callable[[Progress], None] | None = None,
                  should_cancel: Callable[[], bool] | None = None, started: float | None = None,
                  importance: Mapping[str, torch.Tensor] | None = None) -> Report:
    """Quantize the GGUF model of ``reader`` into the GGUF file ``dst`` and return the Report."""
    from ..pipeline import check_finite_quickly, summarize

    t0 = time.perf_counter() if started is None else started
    reader = gguf_input(reader)
    gf = reader.file
    plans = plan_file(reader, config, has_imatrix=bool(importance))
    outs = []
    for p in plans:
        e = reader.entry(p.info.name)
        outs.append(OutTensor(e.name, e.ne, e.type_id if p.scheme is None else _type_id(p.scheme)))
    overrides = {"general.file_type": (U32, _file_type(config, plans)), "general.quantization_version": (U32, 2)}
    progress = Progress(tensors_total=len(plans), bytes_total=sum(p.info.nbytes for p in plans))
    if on_progress is not None:
        on_progress(progress)
    reports: list[TensorReport] = []
    with GGUFWriter(dst, gf.metadata, outs, alignment=gf.alignment, overrides=overrides) as writer:
        for p, out in zip(plans, outs, strict=True):
            if should_cancel is not None and should_cancel():
                raise JobCancelled(f"cancelled after {len(reports)} of {len(plans)} tensors")
            name, shape = p.info.name, list(p.info.shape)
            if p.scheme is None:
                raw = reader.raw(name)
                float_type = FLOAT_TYPES.get(reader.entry(name).type_id)
                if float_type is not None and raw:  # kept float tensors hold no NaN/Inf either (checked on the bytes read)
                    check_finite_quickly(torch.frombuffer(raw, dtype=float_type), name)
                writer.write(name, raw)
                reports.append(TensorReport(name=name, shape=shape, in_dtype=p.info.dtype, scheme=None, stats=None,
                                            skipped=True, reason=p.reason))
            else:
                x = reader.load(name, device)
                check_finite_quickly(x, name)
                e = reader.entry(name)
                in_bits = FLOAT_TYPES[e.type_id].itemsize * 8
                stats, data = _quantize_one(x, p.scheme, name, _importance(importance, name, p.info.shape), in_bits)
                if data.numel() * data.element_size() != tensor_nbytes(out.type_id, out.ne):
                    raise RuntimeError(f"{name}: encoded size does not match the table")
                writer.write(name, data)
                reports.append(TensorReport(name=name, shape=shape, in_dtype=p.info.dtype, scheme=p.scheme,
                                            stats=stats, skipped=False, reason=p.reason))
                del x, data
            done = progress.bytes_done + p.info.nbytes
            progress = Progress(tensors_done=len(reports), tensors_total=len(plans), bytes_done=done,
                                bytes_total=progress.bytes_total,
                                fraction=done / progress.bytes_total if progress.bytes_total else 1.0)
            if on_progress is not None:
                on_progress(progress)
        size = writer.finish()
    summary = summarize(plans, reports, input_bytes(), size, time.perf_counter() - t0, device)
    return Report(job_id=job_id, config=config, summary=summary, tensors=reports)


@register
class GGUFOutput(OutputFormat):
    name = "gguf"
    suffix = ".gguf"
    description = ("llama.cpp's GGUF from a GGUF input: ggml block types (q8_0 … q6_k) or a llama.cpp mix "
                   "(gguf_mix), every metadata key kept; run with llama-cli / llama-server")

    def check(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> None:
        _check_dtype(name, scheme.dtype)

    def layout(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
        return [OutputTensor(name, "U8" if DTYPES[scheme.dtype].kind == "ggml" else "F16", shape)]

    def encode(self, qt: QuantizedTensor, name: str) -> dict[str, torch.Tensor]:
        raise ConfigError("GGUF tensors are encoded by the GGUF pipeline (quantize_gguf)", field="output")

    def open_sink(self, dst: str | os.PathLike[str], plans: Sequence[PlannedTensor], *,
                  extra_meta: Mapping[str, Any] | None = None) -> Sink:
        raise ConfigError('output "gguf" is written from a GGUF input by quantize_gguf', field="output")
