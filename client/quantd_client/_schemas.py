"""The v1 wire schemas, defined once (pure pydantic). The server imports them from here.

Field names and meanings follow CONTRACT.md; extra fields are additions, never renames.
"""

from __future__ import annotations

import fnmatch
import math
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_serializer,
    model_validator,
)

from ._dtypes import DTYPES, OUTPUT_FORMATS

# The names of dtypes, granularities, observers, methods and formats, defined once: `/v1/info`, the CLI's
# choices and the engine's tables are derived from these (`typing.get_args`), and tests pin the engine's
# registries to them.
DType = Literal[
    "int8", "int4", "int3", "int2", "uint8", "uint4", "nf4", "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16",
    "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
]
GranularityName = Literal["tensor", "channel", "group"]
ObserverName = Literal["minmax", "percentile", "meanstd", "ema", "mse", "entropy"]
# The one table of method names (the engine's method registry is pinned to it by a test).
MethodName = Literal["rtn", "hqq", "gptq", "awq"]
# A number in a config: NaN and ±Inf are refused where the config is read (a 422), never carried to a method.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# A method argument is a JSON boolean, integer or finite number as given: no strings ("3", "yes") read
# as one, integers kept integers (an iteration count), booleans kept booleans.
MethodArgValue = Annotated[bool, Strict()] | Annotated[int, Strict()] | Annotated[FiniteFloat, Strict()]
ScaleDType = Literal["float16", "bfloat16", "float32"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
InputFormat = Literal["safetensors", "pytorch", "npy", "npz", "gguf"]
# A calibration part that is not a model file: llama.cpp's importance matrix (a GGUF job's calibration), or
# JSONL text / token ids that the worker runs through a model directory (CONTRACT §10).
CalibrationFormat = Literal["imatrix", "jsonl"]
GGUFMix = Literal["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0",
                  "Q4_1", "Q5_0", "Q5_1"]
# The output formats' names, listed once in ``_dtypes.OUTPUT_FORMATS`` (the server's format registry checks
# at import that it registers exactly these).
if TYPE_CHECKING:
    OutputFormatName = str
else:
    OutputFormatName = Literal[OUTPUT_FORMATS]

_OBSERVER_ARGS: dict[str, set[str]] = {
    "minmax": set(),
    "percentile": {"percentile"},
    "meanstd": {"k"},
    "ema": {"momentum"},
    "mse": {"grid", "min_ratio", "norm"},
    "entropy": {"bins", "quant_bins"},
}


def default_symmetric(dtype: str) -> bool:
    """nf4 and fp8 have no zero point; integer dtypes default to affine as CONTRACT §1 shows."""
    return DTYPES[dtype].kind in ("nf4", "fp8")


def default_granularity(dtype: str) -> GranularityName:
    """8-bit dtypes (int8, uint8, fp8) default to one scale per output channel, as torchao and llm-compressor
    quantize 8-bit weights; narrower dtypes to groups of ``group_size``."""
    return "channel" if DTYPES[dtype].bits == 8 else "group"


# Embedding tables and output heads, by the name of their module (the last part before ``.weight``, compared
# in lower case): ``word_embeddings``, ``embed_tokens``, ``token_type_embeddings``, GPT-2's ``wte``/``wpe``,
# ``lm_head``.
EMBEDDING_MODULES = ("*embed*", "wte", "wpe", "lm_head", "embed_out")
# llama.cpp's names of the same (GGUF files): ``token_embd``, ``position_embd``, ``per_layer_token_embd``, and the
# head ``output.weight`` (a top-level name, as InternLM's head too).
GGUF_EMBEDDING_MODULES = ("*_embd",)
GGUF_EMBEDDING_NAMES = ("output.weight",)


def is_embedding(name: str, *, gguf_names: bool = True) -> bool:
    """Whether ``name`` is the weight of an embedding table or output head (:data:`EMBEDDING_MODULES`, and with
    ``gguf_names`` llama.cpp's :data:`GGUF_EMBEDDING_MODULES` and :data:`GGUF_EMBEDDING_NAMES`)."""
    if gguf_names and name in GGUF_EMBEDDING_NAMES:
        return True
    module = name.removesuffix(".weight").rsplit(".", 1)[-1].lower()
    patterns = EMBEDDING_MODULES + GGUF_EMBEDDING_MODULES if gguf_names else EMBEDDING_MODULES
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The validation context of a job read back (from the database, or from the server by the SDK): see _as_stored.
STORED = {"stored": True}


def _as_stored(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """``method_args`` and ``observer_args`` as a job row holds them, when read back with the context
    ``{"stored": True}`` (the server reading its database, the SDK reading the server's jobs): an older release
    took values today's rules refuse (a NaN, served as null), and such a job is still shown, not an error."""
    if isinstance(info.context, dict) and info.context.get("stored") and isinstance(value, dict):
        try:
            return handler(value)
        except ValidationError:
            return value
    return handler(value)


class Scheme(_Strict):
    """How one tensor is quantized. ``symmetric`` left out means: affine for integer dtypes,
    symmetric for nf4/fp8 (they have no zero point). ``granularity`` left out means: per channel for
    8-bit dtypes, per group for narrower ones (and per group whenever ``group_size`` is given)."""

    dtype: DType = "int4"
    symmetric: bool = False
    granularity: GranularityName = Field(
        default="group", description="tensor | channel | group. Left out: channel for 8-bit dtypes (int8, uint8, fp8), "
                             "group for narrower ones or when group_size is given")
    axis: int = 0
    group_size: int = Field(default=128, ge=1)
    observer: ObserverName = "minmax"
    observer_args: Annotated[dict[str, FiniteFloat], WrapValidator(_as_stored)] = Field(default_factory=dict)
    method: MethodName = "rtn"
    method_args: Annotated[dict[str, MethodArgValue], WrapValidator(_as_stored)] = Field(
        default_factory=dict, description="the method's own arguments (/v1/info.method_args lists them); "
                                          "an argument the method does not take is refused with 422")
    scale_dtype: ScaleDType = "float16"

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"dtype": "int4", "symmetric": False, "granularity": "group",
                                         "group_size": 128, "observer": "minmax"}]},
    )

    @model_validator(mode="after")
    def _check(self) -> Scheme:
        info = DTYPES[self.dtype]
        if "symmetric" not in self.model_fields_set:
            # Resolved without marking the field as set, so rule overrides can still re-resolve it.
            object.__setattr__(self, "symmetric", default_symmetric(self.dtype))
        if "granularity" not in self.model_fields_set and "group_size" not in self.model_fields_set:
            object.__setattr__(self, "granularity", default_granularity(self.dtype))  # unset, as symmetric
        if info.kind == "int" and not info.signed and self.symmetric:
            raise ValueError(f"scheme.symmetric: {self.dtype} is unsigned and needs a zero point; "
                             "use symmetric=false or a signed dtype")
        if info.kind in ("fp8", "nf4") and not self.symmetric:
            raise ValueError(f"scheme.symmetric: {self.dtype} has no zero point; use symmetric=true")
        allowed = _OBSERVER_ARGS[self.observer]
        unknown = set(self.observer_args) - allowed
        if unknown:
            raise ValueError(f"scheme.observer_args: {sorted(unknown)} not understood by observer "
                             f"{self.observer!r} (it takes {sorted(allowed) or 'no arguments'})")
        p = self.observer_args.get("percentile")
        if p is not None and not 50.0 < p <= 100.0:  # affine keeps [P(100 − p), P(p)]: below 50 it inverts
            raise ValueError("scheme.observer_args.percentile must be in (50, 100]")
        k = self.observer_args.get("k")
        if k is not None and not 0.0 < k < math.inf:
            raise ValueError("scheme.observer_args.k must be > 0 and finite")
        m = self.observer_args.get("momentum")
        if m is not None and not 0.0 < m <= 1.0:
            raise ValueError("scheme.observer_args.momentum must be in (0, 1]")
        g = self.observer_args.get("grid")
        if g is not None and not 1 <= g <= 1000:
            raise ValueError("scheme.observer_args.grid must be in [1, 1000]")
        r = self.observer_args.get("min_ratio")
        if r is not None and not 0.0 < r <= 1.0:
            raise ValueError("scheme.observer_args.min_ratio must be in (0, 1]")
        n = self.observer_args.get("norm")
        if n is not None and not n > 0:
            raise ValueError("scheme.observer_args.norm must be > 0")
        levels = info.levels if info.kind == "int" else 2 ** info.bits
        for key, hi in (("bins", 65536), ("quant_bins", levels)):  # no more quantization bins than levels
            b = self.observer_args.get(key)
            if b is not None and not (2 <= b <= hi and float(b).is_integer()):
                raise ValueError(f"scheme.observer_args.{key} must be an integer in [2, {hi}] for {self.dtype}")
        return self


class SchemeOverride(_Strict):
    """A partial scheme in a rule: the fields given replace the config's default scheme (a new ``dtype``
    without ``symmetric`` takes its own default; a ``group_size`` without ``granularity`` means "group")."""

    dtype: DType | None = None
    symmetric: bool | None = None
    granularity: GranularityName | None = None
    axis: int | None = None
    group_size: int | None = Field(default=None, ge=1)
    observer: ObserverName | None = None
    observer_args: Annotated[dict[str, FiniteFloat] | None, WrapValidator(_as_stored)] = None
    method: MethodName | None = None
    method_args: Annotated[dict[str, MethodArgValue] | None, WrapValidator(_as_stored)] = None
    scale_dtype: ScaleDType | None = None


class Rule(_Strict):
    """Tensors matching ``match`` are skipped (``skip``) or take ``scheme`` over the default (neither: the
    default scheme, which quantizes 1-D tensors too: it overrides ``skip_1d``)."""

    match: str = Field(..., min_length=1, description="glob on tensor names (fnmatch)")
    scheme: SchemeOverride | None = None
    skip: bool = False

    @model_validator(mode="after")
    def _check(self) -> Rule:
        if self.skip and self.scheme is not None:  # skip won silently: the scheme was never used
            raise ValueError(f"rule {self.match!r}: give skip or a scheme, not both")
        return self


class ObserverSpec(_Strict):
    """The ``observer`` form field of /v1/calibrate: how activation ranges are observed."""

    dtype: DType = "int8"
    symmetric: bool = False
    observer: ObserverName = "minmax"
    observer_args: Annotated[dict[str, FiniteFloat], WrapValidator(_as_stored)] = Field(default_factory=dict)
    granularity: Literal["tensor", "channel"] = "tensor"
    axis: int = Field(default=-1, description="channel: the feature axis of the [N, ...] samples (default: the last)")

    @model_validator(mode="after")
    def _check(self) -> ObserverSpec:
        scheme = self.as_scheme()  # the same dtype/symmetric/observer_args rules as a weight scheme
        if "symmetric" not in self.model_fields_set:  # the dtype's default, as sent on the wire (nf4/fp8: true)
            object.__setattr__(self, "symmetric", scheme.symmetric)
        return self

    def as_scheme(self) -> Scheme:
        data = self.model_dump(exclude_unset=True)  # symmetric left out: the dtype's own default
        data.setdefault("dtype", self.dtype)  # int8, not a weight scheme's int4
        data.setdefault("granularity", "tensor")
        data.setdefault("axis", self.axis)
        return Scheme.model_validate(data)


# Bounds of model-aware calibration (CONTRACT §10): enough for any published recipe, small enough that a
# config cannot ask a worker for unbounded activations.
MAX_CALIBRATION_SAMPLES = 4096
MAX_CALIBRATION_SEQ_LEN = 32768


class CalibrationSpec(_Strict):
    """How a JSONL calibration part is used (CONTRACT §10): the worker runs the model on the first
    ``samples`` lines, each truncated to ``max_seq_len`` tokens."""

    samples: int = Field(default=128, ge=1, le=MAX_CALIBRATION_SAMPLES,
                         description="calibration lines used (the first ones of the file)")
    max_seq_len: int = Field(default=512, ge=1, le=MAX_CALIBRATION_SEQ_LEN,
                             description="tokens per line at most (longer lines are truncated)")


class QuantConfig(_Strict):
    scheme: Scheme = Field(default_factory=lambda: Scheme())
    rules: list[Rule] = Field(default_factory=list)
    skip_1d: bool = True
    skip_embeddings: bool = Field(
        default=True, description="embedding tables and output heads stay in full precision unless a rule matches "
                          "them: weights whose module name (the last part before .weight) matches one of "
                          + ", ".join(repr(p) for p in EMBEDDING_MODULES) + " (fnmatch, case-insensitive); "
                          "unless the output is GGUF (which keeps llama.cpp's choice), also llama.cpp's "
                          + ", ".join(repr(p) for p in GGUF_EMBEDDING_MODULES) + " and the tensor "
                          + ", ".join(repr(p) for p in GGUF_EMBEDDING_NAMES))
    min_numel: int = Field(default=0, ge=0)
    output: OutputFormatName = Field(default="safetensors", description="the artifact's format (GET /v1/info lists them)")
    activations: ObserverSpec | None = Field(
        default=None, description="how activation ranges are observed when a job comes with a calibration file "
                          "(default: int8 affine min-max per tensor); the ranges land in the report and "
                          "the artifact's metadata for static activation quantization")
    gguf_mix: GGUFMix | None = Field(
        default=None, description="with output \"gguf\": pick each tensor's ggml type as llama.cpp's mix of this name "
                          "does (llama-quantize's file type), in place of the default scheme; rules still "
                          "override it per tensor")
    calibration: CalibrationSpec | None = Field(
        default=None, description="with a JSONL calibration part on a model directory (gptq, awq): how many lines the "
                          "worker runs through the model and how many tokens each keeps (defaults 128 and 512)")

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{
            "scheme": {"dtype": "int4", "symmetric": False, "granularity": "group", "group_size": 128},
            "rules": [{"match": "lm_head.*", "scheme": {"dtype": "int8", "granularity": "channel"}},
                      {"match": "*.bias", "skip": True}],
            "skip_1d": True, "min_numel": 0, "output": "safetensors"}]},
    )

    @model_validator(mode="after")
    def _check_rules(self) -> QuantConfig:
        if self.output != "gguf":
            if self.gguf_mix is not None:
                raise ValueError('gguf_mix: needs output "gguf"')
            ggml = [("scheme.dtype", self.scheme.dtype)] + [
                (f"rules[{i}].scheme.dtype", r.scheme.dtype) for i, r in enumerate(self.rules)
                if r.scheme is not None and r.scheme.dtype is not None]
            for loc, dtype in ggml:
                if DTYPES[dtype].kind == "ggml":
                    raise ValueError(f'{loc}: {dtype} is a ggml block type, valid only with output "gguf"')
        for i, rule in enumerate(self.rules):
            if rule.scheme is not None:
                try:
                    self.override_scheme(rule.scheme)
                except ValidationError as e:  # its own messages, not pydantic's multi-line summary
                    why = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
                    raise ValueError(f"rules[{i}] (the tensors matching {rule.match!r}): {why}") from None
        return self

    def override_scheme(self, override: SchemeOverride) -> Scheme:
        """The default scheme with ``override``'s fields (a rule's, or the CLI's flags) on top."""
        base = self.scheme.model_dump(exclude_unset=True)
        patch = override.model_dump(exclude_none=True)
        new_dtype = "dtype" in patch and patch["dtype"] != base.get("dtype", "int4")
        if new_dtype and "symmetric" not in patch:
            base.pop("symmetric", None)  # a new dtype re-resolves its own default
        if "group_size" in patch and "granularity" not in patch:
            patch["granularity"] = "group"  # a group size asks for groups (not ignored under a per-channel default)
        return Scheme.model_validate({**base, **patch})

    def scheme_for(self, name: str, shape: tuple[int, ...] | list[int]) -> tuple[Scheme | None, str | None]:
        """The scheme for one tensor, or ``(None, reason)`` when it stays as it is."""
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel < self.min_numel:  # whatever the rules say (CONTRACT §1: only skip_1d yields to them)
            return None, f"numel {numel} < min_numel {self.min_numel}"
        for rule in self.rules:
            if fnmatch.fnmatchcase(name, rule.match):
                if rule.skip:
                    return None, f"rule {rule.match!r}: skip"
                return (self.override_scheme(rule.scheme) if rule.scheme else self.scheme), None
        if self.skip_1d and len(shape) <= 1:
            return None, "1-D tensor (skip_1d)"
        # A GGUF output keeps llama.cpp's choice for its own names (it quantizes token_embd and output too).
        if self.skip_embeddings and is_embedding(name, gguf_names=self.output != "gguf"):
            return None, "embedding table or output head (skip_embeddings)"
        return self.scheme, None


class ErrorStats(BaseModel):
    """Error statistics of one quantized tensor (CONTRACT §4).

    ``sqnr_db`` is ``10·log10(mean(x²)/mse)``; it is null when the error is exactly zero (infinite).
    Outliers are elements with ``|x − mean| > outlier_threshold`` (= 3 standard deviations).
    ``theoretical_max_error`` is half the largest quantization step; unclipped elements never exceed it.
    """

    numel: int
    mse: float
    mae: float
    max_abs_error: float
    sqnr_db: float | None
    cosine: float
    outlier_rate: float
    outlier_threshold: float
    clipped_fraction: float
    theoretical_max_error: float | None
    bits_per_weight: float
    compression_ratio: float
    theoretical_sqnr_db: float | None = None  # 6.02·b + 1.76 dB for integer dtypes
    # With calibration for the tensor (CONTRACT §10): tr(ΔW H ΔWᵀ) / tr(W H Wᵀ), H = Σ x xᵀ of its inputs.
    output_rel_error: float | None = None


class TensorReport(BaseModel):
    name: str
    shape: list[int]
    in_dtype: str
    scheme: Scheme | None
    stats: ErrorStats | None
    skipped: bool
    reason: str | None = None


class Summary(BaseModel):
    tensors_quantized: int
    tensors_skipped: int
    input_bytes: int
    output_bytes: int
    compression_ratio: float
    bits_per_weight: float
    mean_sqnr_db: float | None
    min_sqnr_db: float | None
    worst_tensor: str | None
    elapsed_s: float
    device: str


class Report(BaseModel):
    job_id: str | None
    config: QuantConfig
    summary: Summary
    tensors: list[TensorReport]
    activations: list[LayerCalibration] | None = None  # when a calibration file came with the job


class FileEntry(BaseModel):
    """One file of a model directory (relative POSIX path) or of a job's output."""

    path: str
    bytes: int
    sha256: str


class _FilesWhenSet(BaseModel):
    """``files`` is left out of the JSON when unset: a one-file job's documents stay exactly v1's."""

    @model_serializer(mode="wrap")
    def _drop_unset_files(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("files", 0) is None:
            del data["files"]
        return data


class FileList(BaseModel):
    """``GET /v1/jobs/{id}/files``: the job's output files."""

    files: list[FileEntry]


class InputInfo(_FilesWhenSet):
    filename: str
    bytes: int
    sha256: str
    format: InputFormat | CalibrationFormat
    tensors: int
    files: list[FileEntry] | None = Field(
        default=None, description="a model directory job's files (relative paths); absent for a one-file job")


class Progress(BaseModel):
    tensors_done: int = 0
    tensors_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    fraction: float = 0.0


class JobResult(_FilesWhenSet):
    artifact_bytes: int
    artifact_sha256: str
    summary: Summary
    files: list[FileEntry] | None = Field(
        default=None, description="a directory output's files (the artifact is then their tar); absent for one file")


class JobError(BaseModel):
    type: str
    title: str
    detail: str


class Job(BaseModel):
    id: str
    status: JobStatus
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    input: InputInfo
    config: QuantConfig
    progress: Progress = Field(default_factory=Progress)
    device: str | None = None
    result: JobResult | None = None
    error: JobError | None = None
    attempts: int = 0
    cancel_requested: bool = False  # DELETE seen on a running job; it ends cancelled at the next tensor
    expired_at: datetime | None = None  # files removed after the TTL (report/artifact then answer 410)
    source: str | None = None  # a job by reference: the s3:// object it reads
    destination: str | None = None  # ... and where its artifact is written too


class JobByReference(BaseModel):
    """``POST /v1/jobs`` as JSON: quantize an object the server reads itself (CONTRACT §11). Only ``s3://``
    URLs under the tenant's allowed prefixes (``QUANTD_SOURCE_PREFIXES``); anything else is 403."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "config": {"scheme": {"dtype": "int4", "group_size": 128}},
        "source": "s3://models/llama/model.safetensors", "destination": "s3://models/llama-int4/"}]})

    config: QuantConfig
    source: str = Field(max_length=1024, description=(
        "s3://bucket/key of one model file, or a model directory: a prefix ending in '/'"))
    destination: str | None = Field(default=None, max_length=1024, description=(
        "s3://bucket/key for the artifact, or a prefix ending in '/' (the source's name + .quantd.safetensors; "
        "a directory output writes every file under it, and needs a prefix); the job's own files stay "
        "downloadable too"))


class JobList(BaseModel):
    items: list[Job]
    next_cursor: str | None = None


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[dict[str, Any]] | None = None
    request_id: str | None = None


class AnalyzeResult(BaseModel):
    scheme: Scheme
    stats: ErrorStats


class BitWidthResult(BaseModel):
    """One integer dtype of a bit-width comparison: measured SQNR beside 6.02·b + 1.76 dB."""

    dtype: str
    bits: int
    stats: ErrorStats
    theoretical_sqnr_db: float
    sqnr_db: float | None  # measured; None when the error is exactly zero


class OutlierImpactResult(BaseModel):
    """The range clipped at one percentile (100 = min-max): error overall, on outliers and inliers."""

    percentile: float
    mse: float
    sqnr_db: float | None
    clipped_fraction: float
    outlier_fraction: float
    mse_outliers: float | None  # None when there is no outlier
    mse_inliers: float | None


class ScaleSensitivityResult(BaseModel):
    """Every scale multiplied by (1 + perturbation): the MSE change relative to the unperturbed scales."""

    perturbation: float
    scale_ratio: float  # mean of perturbed / base scales after rounding to scale_dtype
    mse: float
    relative_mse_change: float | None  # mse / base mse − 1; None when the base mse is 0


AnalysisName = Literal["bit_widths", "outlier_impact", "scale_sensitivity"]


class TensorAnalyses(BaseModel):
    """Analyses asked for in /v1/analyze's optional ``analyses`` field, on the first scheme."""

    bit_widths: list[BitWidthResult] | None = None
    outlier_impact: list[OutlierImpactResult] | None = None
    scale_sensitivity: list[ScaleSensitivityResult] | None = None


class AnalyzeTensor(BaseModel):
    name: str
    shape: list[int]
    results: list[AnalyzeResult]
    analyses: TensorAnalyses | None = None


class AnalyzeResponse(BaseModel):
    tensors: list[AnalyzeTensor]


class LayerCalibration(BaseModel):
    name: str
    min: float | list[float]
    max: float | list[float]
    scale: float | list[float]
    zero_point: int | list[int]
    observer: str
    num_samples: int


class CalibrateResponse(BaseModel):
    layers: list[LayerCalibration]


class DeviceInfo(BaseModel):
    name: str
    type: str
    memory_bytes: int | None = None


class MethodArg(BaseModel):
    """One argument a method takes in ``scheme.method_args``."""

    name: str
    type: Literal["float", "int", "bool"]
    default: bool | int | float  # as its type says: an int argument's default and bounds are integers
    min: int | float | None = None
    max: int | float | None = None
    description: str


class MethodInfo(BaseModel):
    """A method of ``scheme.method``: what it needs (``none``; ``hessian``: a calibration file with each
    Linear's input rows or Hessian, CONTRACT §10) and the arguments it takes."""

    name: str
    needs: Literal["none", "hessian"]
    description: str
    args: list[MethodArg]


class Limits(BaseModel):
    max_upload_bytes: int
    max_sync_bytes: int
    max_analyze_configs: int = 16
    max_queue: int


class Info(BaseModel):
    version: str
    devices: list[DeviceInfo]
    dtypes: list[str]
    observers: list[str]
    methods: list[str]
    method_args: list[MethodInfo] = Field(default_factory=list, description="each method with its arguments")
    granularities: list[str]
    input_formats: list[str]
    output_formats: list[str]
    gguf_mixes: list[str] = Field(default_factory=list, description="the llama.cpp mixes config.gguf_mix takes")
    limits: Limits
    auth: bool = False


Report.model_rebuild()
