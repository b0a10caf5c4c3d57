"""The quantd artifact (CONTRACT §5): an incrementally written safetensors file, and its torch reader.

Write path: every output tensor's dtype/shape is planned before quantizing, so the header (with
room reserved for the summary) is written first, each tensor's bytes are streamed to their
planned offsets as they are produced, and the header is rewritten in place at the end (padded
with spaces, which the safetensors format allows). Written to ``dst.tmp``, then ``os.replace``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch import nn

from quantd.engine.granularity import check_applicable, granularity_of, scale_shape
from quantd.engine.kernels.quantize import NF4_LEVELS
from quantd.engine.packing import packed_nbytes
from quantd.engine.types import QuantizedTensor
from quantd.errors import MalformedInputError
from quantd_client import Scheme
from quantd_client._dtypes import DTYPES

from .formats import ST_ITEMSIZE, ST_TO_TORCH, TORCH_TO_ST, dtype_name, torch_dtype
from .readers import SafetensorsReader

FORMAT_VERSION = 1
SCALE_ST = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the artifact: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]


def quantized_layout(name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
    """The artifact tensors of ``name`` quantized with ``scheme``; ConfigError if it cannot apply."""
    info = DTYPES[scheme.dtype]
    numel = math.prod(shape)
    if info.kind == "float":
        return [OutputTensor(f"{name}.qdata", info.storage, shape)]
    sshape = scale_shape(shape, granularity_of(scheme), name=name)
    if info.packed:
        qdata = OutputTensor(f"{name}.qdata", "U8", (packed_nbytes(numel, info.bits),))
    else:
        qdata = OutputTensor(f"{name}.qdata", info.storage, shape)
    out = [qdata, OutputTensor(f"{name}.scale", SCALE_ST[scheme.scale_dtype], sshape)]
    zp_domain, g_idx, channel_scale = _method_extras(scheme, name)
    if info.kind == "int" and not scheme.symmetric:
        zp_st = SCALE_ST[scheme.scale_dtype] if zp_domain == "float" else "I8" if info.signed else "U8"
        out.append(OutputTensor(f"{name}.zero_point", zp_st, sshape))
    cols = numel // shape[0] if shape else 1
    if g_idx:  # CONTRACT §10: one group index per column of the [rows, cols] view
        out.append(OutputTensor(f"{name}.g_idx", "I32", (cols,)))
    if channel_scale:
        out.append(OutputTensor(f"{name}.channel_scale", "F32", (cols,)))
    return out


def _method_extras(scheme: Scheme, name: str) -> tuple[str, bool, bool]:
    """The method's zero point domain and whether it stores ``g_idx`` / ``channel_scale``."""
    from quantd.engine.methods import artifact_extras

    return artifact_extras(scheme, name=name)


def quantized_meta(shape: tuple[int, ...], orig_dtype: torch.dtype, scheme: Scheme) -> dict[str, Any]:
    """The ``__metadata__["quantd"]["tensors"][N]`` entry."""
    info = DTYPES[scheme.dtype]
    # The axis as the engine normalises it (a negative axis counted from the end).
    axis = 0 if info.kind == "float" else check_applicable(shape, granularity_of(scheme), name="tensor")
    return {
        "dtype": scheme.dtype, "shape": list(shape), "orig_dtype": dtype_name(orig_dtype),
        "symmetric": scheme.symmetric, "granularity": scheme.granularity, "axis": axis,
        "group_size": scheme.group_size, "method": scheme.method, "observer": scheme.observer,
        **({"method_args": dict(scheme.method_args)} if scheme.method_args else {}),
        **({"zero_point_domain": "float"} if _method_extras(scheme, "tensor")[0] == "float" else {}),
        "observer_args": dict(scheme.observer_args), "scale_dtype": scheme.scale_dtype,
        "packed_bits": info.bits if info.packed else None,
        # nf4 codes are indices into this table (QLoRA's, as float32): x̂ = codebook[code] · scale. Written
        # out so that a reader need not know it.
        **({"codebook": list(NF4_LEVELS)} if info.kind == "nf4" else {}),
    }


def _packed_codes(codes: torch.Tensor, qmin: int, bits: int) -> torch.Tensor:
    """The CONTRACT §5 bitstream of ``codes − qmin``: one fused pass on CPU, else offsets then ``pack``."""
    from quantd.engine.kernels import KERNELS
    from quantd.engine.kernels.packing import pack_codes
    from quantd.engine.packing import pack

    flat = codes.reshape(-1)
    if flat.numel() % 8 == 0 and KERNELS.wants(flat):
        fused = pack_codes(flat, qmin, bits)
        if fused is not None:
            return fused
    if codes.dtype == torch.uint8 and qmin == 0:  # the codes are the offsets
        return pack(flat, bits)
    if codes.dtype == torch.int8 and bits < 8:  # code − qmin ≤ 2**bits − 1 ≤ 127: no wrap-around in int8
        return pack((flat - qmin).view(torch.uint8), bits)
    return pack((flat.to(torch.int16) - qmin).to(torch.uint8), bits)


def encode_quantized(qt: QuantizedTensor, name: str) -> dict[str, torch.Tensor]:
    """The artifact tensors of one QuantizedTensor (codes packed below 8 bits, CONTRACT §5)."""
    info = DTYPES[qt.dtype]
    if info.kind == "float":
        return {f"{name}.qdata": qt.codes}
    if info.packed:
        qdata = _packed_codes(qt.codes, info.qmin, info.bits)
    elif info.kind == "int":
        qdata = qt.codes.to(torch.int8 if info.signed else torch.uint8)
    else:
        qdata = qt.codes
    if qt.scale is None:
        raise ValueError(f"tensor {name!r}: {qt.dtype} result has no scale")
    out = {f"{name}.qdata": qdata, f"{name}.scale": qt.scale}
    if qt.zero_point is not None:
        out[f"{name}.zero_point"] = (qt.zero_point.to(qt.scale.dtype) if qt.zero_point_domain == "float"
                                     else qt.zero_point.to(torch.int8 if info.signed else torch.uint8))
    if qt.g_idx is not None:
        out[f"{name}.g_idx"] = qt.g_idx.to(torch.int32)
    if qt.channel_scale is not None:
        out[f"{name}.channel_scale"] = qt.channel_scale.to(torch.float32)
    return out


def _header_bytes(layout: list[OutputTensor], offsets: dict[str, tuple[int, int]], quantd: dict[str, Any],
                  size: int | None) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"quantd": json.dumps(quantd, separators=(",", ":"))}}
    for o in layout:
        header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": list(offsets[o.name])}
    raw = json.dumps(header, separators=(",", ":")).encode()
    if size is not None:
        if len(raw) > size:
            raise RuntimeError(f"artifact header of {len(raw)} bytes overflows its reserved {size} bytes")
        raw += b" " * (size - len(raw))
    return raw


# Header bytes kept per quantized tensor for its ErrorStats JSON (15 fields of ≤ 25 characters + names).
_STATS_RESERVE = 800


class ArtifactWriter:
    """Streams the artifact tensors to ``dst.tmp``; :meth:`finish` writes the summary and renames.

    ``layout`` is every output tensor in file order; ``tensors_meta`` the per-quantized-tensor
    metadata. Each tensor is written once, with exactly the planned dtype and shape.
    """

    def __init__(self, dst: str | os.PathLike[str], layout: list[OutputTensor],
                 tensors_meta: Mapping[str, Mapping[str, Any]], *, summary_reserve: int | None = None,
                 extra_meta: Mapping[str, Any] | None = None) -> None:
        self.dst = Path(dst)
        self.tmp = self.dst.with_name(self.dst.name + ".tmp")
        self._layout = {o.name: o for o in layout}
        if len(self._layout) != len(layout):
            raise ValueError("duplicate artifact tensor names")
        self._offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for o in layout:
            self._offsets[o.name] = (pos, pos + o.nbytes)
            pos += o.nbytes
        self.data_bytes = pos
        self._meta: dict[str, Any] = {"format_version": FORMAT_VERSION, "producer": "quantd",
                                      "tensors": {k: dict(v) for k, v in tensors_meta.items()}, "summary": None,
                                      **(extra_meta or {})}
        longest = max((len(n) for n in self._layout), default=0)
        # Room for the summary and for each quantized tensor's ErrorStats, filled in by finish().
        reserve = (summary_reserve if summary_reserve is not None else 4096 + 16 * longest) \
            + _STATS_RESERVE * len(self._meta["tensors"])
        n = len(_header_bytes(layout, self._offsets, self._meta, None)) + reserve
        self._header_len = n + (-(8 + n)) % 8  # data starts 8-byte aligned
        self._written: set[str] = set()
        self._f = self.tmp.open("wb")
        self._f.write(self._header_len.to_bytes(8, "little"))
        self._f.write(_header_bytes(layout, self._offsets, self._meta, self._header_len))

    @property
    def data_start(self) -> int:
        return 8 + self._header_len

    def write(self, name: str, tensor: torch.Tensor) -> None:
        o = self._layout.get(name)
        if o is None or name in self._written:
            raise RuntimeError(f"artifact tensor {name!r} is not planned or already written")
        if TORCH_TO_ST.get(tensor.dtype) != o.dtype or tuple(tensor.shape) != o.shape:
            raise RuntimeError(f"artifact tensor {name!r}: got {tensor.dtype} {list(tensor.shape)}, planned "
                               f"{o.dtype} {list(o.shape)}")
        if o.nbytes:
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._f.seek(self.data_start + self._offsets[name][0])
            self._f.write(raw.data)
        self._written.add(name)

    @property
    def total_bytes(self) -> int:
        """The size the finished artifact will have (known up front: the header room is reserved)."""
        return self.data_start + self.data_bytes

    def finish(self, summary: Mapping[str, Any] | None,
               tensor_stats: Mapping[str, Mapping[str, Any]] | None = None) -> int:
        """Rewrite the header with ``summary`` (and each quantized tensor's ``stats``), fsync, rename
        into place; returns the artifact size."""
        missing = set(self._layout) - self._written
        if missing:
            raise RuntimeError(f"artifact tensors never written: {sorted(missing)[:5]}")
        self._meta["summary"] = dict(summary) if summary is not None else None
        for name, stats in (tensor_stats or {}).items():
            self._meta["tensors"][name]["stats"] = dict(stats)
        self._f.seek(self.data_start + self.data_bytes)
        self._f.truncate()
        self._f.seek(8)
        self._f.write(_header_bytes(list(self._layout.values()), self._offsets, self._meta, self._header_len))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.dst)
        return self.data_start + self.data_bytes

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None or not self._f.closed:
            self.abort()


# --- reading ---------------------------------------------------------------------------------


def read_quantd_metadata(reader: SafetensorsReader) -> dict[str, Any]:
    raw = reader.header.metadata.get("quantd")
    if raw is None:
        raise MalformedInputError("not a quantd artifact: no __metadata__['quantd']")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise MalformedInputError(f"quantd metadata is not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise MalformedInputError(f"unsupported quantd artifact format_version {meta.get('format_version')!r}")
    return meta


def _decode(reader: SafetensorsReader, name: str, m: Mapping[str, Any], device: str | torch.device
            ) -> QuantizedTensor:
    info = DTYPES[m["dtype"]]
    shape = tuple(int(s) for s in m["shape"])
    qdata = reader.load(f"{name}.qdata", device)
    if info.packed:
        from quantd.engine.packing import unpack

        offsets = unpack(qdata, info.bits, math.prod(shape)).reshape(shape)
        codes = offsets if info.kind == "nf4" else offsets.to(torch.int16) + info.qmin
    else:
        codes = qdata
    names = {t.name for t in reader.tensors}
    scale = reader.load(f"{name}.scale", device) if f"{name}.scale" in names else None
    zp = reader.load(f"{name}.zero_point", device) if f"{name}.zero_point" in names else None
    g_idx = reader.load(f"{name}.g_idx", device) if f"{name}.g_idx" in names else None
    channel_scale = reader.load(f"{name}.channel_scale", device) if f"{name}.channel_scale" in names else None
    return QuantizedTensor(codes=codes, scale=scale, zero_point=zp, shape=shape, dtype=m["dtype"],
                           orig_dtype=torch_dtype(m["orig_dtype"]), granularity=m["granularity"],
                           axis=int(m["axis"]), group_size=int(m["group_size"]), symmetric=bool(m["symmetric"]),
                           method=m.get("method", "rtn"), observer=m.get("observer", "minmax"),
                           zero_point_domain=m.get("zero_point_domain", "int"), g_idx=g_idx,
                           channel_scale=channel_scale)


# The artifact tensors a quantized tensor N owns: N.<suffix>.
OWNED_SUFFIXES = ("qdata", "scale", "zero_point", "g_idx", "channel_scale")


def _passthrough_names(reader: SafetensorsReader, quantized: Mapping[str, Any]) -> list[str]:
    owned = {f"{n}.{suffix}" for n in quantized for suffix in OWNED_SUFFIXES}
    return [t.name for t in reader.tensors if t.name not in owned]


def read_artifact_torch(path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
                        ) -> dict[str, QuantizedTensor]:
    """Every quantized tensor of the artifact at ``path``, unpacked into QuantizedTensor."""
    with SafetensorsReader(Path(path)) as reader:
        meta = read_quantd_metadata(reader)
        return {n: _decode(reader, n, m, device) for n, m in meta["tensors"].items()}


def iter_dequantized(path: str | os.PathLike[str], *, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the artifact, in file order under its original name: quantized ones dequantized
    (to ``dtype``, default their original dtype), the others as stored. One tensor is decoded at a time,
    so memory follows the largest tensor, not the model."""
    from quantd.engine.primitives import dequantize

    with SafetensorsReader(Path(path)) as reader:
        meta = read_quantd_metadata(reader)
        quantized: Mapping[str, Any] = meta["tensors"]
        passthrough = set(_passthrough_names(reader, quantized))
        for t in reader.tensors:
            if t.name in passthrough:
                yield t.name, reader.load(t.name, device)
            elif t.name.endswith(".qdata") and t.name[:-6] in quantized:
                name = t.name[:-6]
                qt = _decode(reader, name, quantized[name], device)
                yield name, dequantize(qt, dtype=dtype or qt.orig_dtype)


def dequantize_artifact(path: str | os.PathLike[str], *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the artifact (see :func:`iter_dequantized`) in one dict."""
    return dict(iter_dequantized(path, device=device, dtype=dtype))


def _dense_layout(reader: SafetensorsReader, quantized: Mapping[str, Any]) -> list[OutputTensor]:
    out = []
    passthrough = set(_passthrough_names(reader, quantized))
    for t in reader.tensors:
        if t.name in passthrough:
            out.append(OutputTensor(t.name, TORCH_TO_ST[torch_dtype(t.dtype)], t.shape))
        elif t.name.endswith(".qdata") and t.name[:-6] in quantized:
            m = quantized[t.name[:-6]]
            out.append(OutputTensor(t.name[:-6], TORCH_TO_ST[torch_dtype(m["orig_dtype"])],
                                    tuple(int(s) for s in m["shape"])))
    return out


def write_dense(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[OutputTensor]:
    """Write the artifact ``src`` back as a plain safetensors file ``dst``: every tensor under its original
    name, shape and dtype, quantized ones dequantized (``x̂``, not the original values). The header carries
    ``{"format": "pt"}`` as ``save_file`` of a torch state dict does, so ``transformers`` loads it.
    Streamed one tensor at a time to ``dst.tmp``, then renamed. Returns the tensors written."""
    with SafetensorsReader(Path(src)) as reader:
        layout = _dense_layout(reader, read_quantd_metadata(reader)["tensors"])
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for o in layout:
        offsets[o.name] = (pos, pos + o.nbytes)
        pos += o.nbytes
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for o in layout:
        header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": list(offsets[o.name])}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    planned = {o.name: o for o in layout}
    out = Path(dst)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name, tensor in iter_dequantized(src):
                o = planned[name]
                if TORCH_TO_ST.get(tensor.dtype) != o.dtype or tuple(tensor.shape) != o.shape:
                    raise MalformedInputError(f"tensor {name!r}: decoded as {tensor.dtype} {list(tensor.shape)}, "
                                              f"the artifact says {o.dtype} {list(o.shape)}", tensor=name)
                if o.nbytes:
                    f.seek(8 + len(raw) + offsets[name][0])
                    f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            f.truncate(8 + len(raw) + pos)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return layout


class LoadResult(NamedTuple):
    """What :func:`load_into_model` did not match (the fields of ``load_state_dict``'s result)."""

    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self) -> str:  # as load_state_dict's result prints
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return f"LoadResult(missing_keys={self.missing_keys!r}, unexpected_keys={self.unexpected_keys!r})"


def _align_prefix(keys: set[str], expected: set[str], prefix: str) -> Callable[[str], str]:
    """The renaming that lines checkpoint ``keys`` up with the model's: a base model's checkpoint loaded into
    a model with a head (keys gain ``prefix.``), or the reverse (they lose it), as transformers does."""
    def same(k: str) -> str:
        return k

    if not prefix or keys & expected:
        return same
    dot = prefix + "."

    def strip(k: str) -> str:
        return k[len(dot):] if k.startswith(dot) else k

    def add(k: str) -> str:
        return dot + k

    best = max((same, strip, add), key=lambda f: len({f(k) for k in keys} & expected))
    return best


def load_into_model(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> LoadResult:
    """Dequantize the artifact into ``model``'s parameters and buffers, one tensor at a time (values are
    cast to each one's dtype and device).

    Checkpoints of real models hold keys the model does not persist (transformers' ``position_ids``,
    registered with ``persistent=False``): those are dropped. A weight tied to another (``lm_head.weight``
    and the input embeddings) may be absent when its twin is loaded. A checkpoint of the base model loads
    into a model with a head and the reverse (``model.base_model_prefix``). Anything else missing or
    unexpected raises ``RuntimeError`` with ``strict=True``, as ``load_state_dict`` does; either way the
    keys are returned."""
    targets: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    transient = {n for n, _ in model.named_buffers(remove_duplicate=False)} - set(targets)
    with SafetensorsReader(Path(path)) as reader:
        names = {o.name for o in _dense_layout(reader, read_quantd_metadata(reader)["tensors"])}
    rename = _align_prefix(names, set(targets), str(getattr(model, "base_model_prefix", "") or ""))
    loaded: set[str] = set()
    unexpected: list[str] = []
    errors: list[str] = []
    with torch.no_grad():
        for name, value in iter_dequantized(path):
            key = rename(name)
            if key in transient or name in transient:
                continue
            target = targets.get(key)
            if target is None:
                unexpected.append(name)
            elif tuple(target.shape) != tuple(value.shape):
                errors.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"the artifact, the shape in the model is {tuple(target.shape)}")
            else:
                target.copy_(value)
                loaded.add(key)
    # Tied weights are one tensor under two names: loading either fills both.
    loaded_ids = {id(targets[k]) for k in loaded}
    missing = [k for k in targets if k not in loaded and id(targets[k]) not in loaded_ids]
    if strict and (missing or unexpected or errors):
        parts = errors + ([f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}."] if missing else []) \
            + ([f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}."] if unexpected else [])
        raise RuntimeError(f"Error(s) in loading the artifact into {type(model).__name__}:\n\t" + "\n\t".join(parts))
    if errors:
        raise RuntimeError("\n".join(errors))
    return LoadResult(missing, unexpected)


__all__ = [
    "ST_TO_TORCH",
    "ArtifactWriter",
    "LoadResult",
    "OutputTensor",
    "dequantize_artifact",
    "encode_quantized",
    "iter_dequantized",
    "load_into_model",
    "quantized_layout",
    "quantized_meta",
    "read_artifact_torch",
    "write_dense",
]
