"""``output: "compressed-tensors"`` (CONTRACT §9.1): the checkpoint layout that vLLM and transformers (with
the ``compressed-tensors`` package) load, matching that library's own compressors (0.20) name for name:

- integer weights below 8 bits, ``pack-quantized``: ``M.weight_packed`` int32 ``[rows, ⌈cols·b/32⌉]``, each
  row the little-endian bitstream of its unsigned offsets ``code − qmin`` (= ``code + 2^(b−1)``), code ``j``
  at bits ``[j·b, j·b + b)``, zero-padded to whole words (``pack_to_int32``); affine zero points
  ``M.weight_zero_point`` packed the same way along the rows (``packed_dim=0``: vLLM's layout), int32
  ``[⌈rows·b/32⌉, groups]``;
- int8, ``int-quantized``, and fp8_e4m3, ``float-quantized``: ``M.weight`` in that dtype, affine int8 zero
  points as int8 ``[rows, groups]``;
- ``M.weight_scale`` ``[rows, groups]`` (channel: ``[rows, 1]``, tensor: ``[1]``) in the scheme's
  ``scale_dtype``; ``M.weight_shape`` int64 ``[2]`` for packed weights; ``M.weight_g_idx`` int32 ``[cols]``
  when the method reorders columns.

Dequantization is the library's: ``(code − zero_point) · scale``, the same values as quantd's own.
Only Linear weights are quantized (found from the architecture that ``config.json`` describes, else every
2-D ``*.weight``); everything else is written as it is.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from quantd.engine.granularity import check_applicable, granularity_of
from quantd.errors import ConfigError
from quantd_client import Scheme
from quantd_client._dtypes import DTYPES

from ..artifact import SCALE_ST, OutputTensor
from ..readers import TensorInfo
from . import register
from .base import ModelStructure, OutputFormat, PlannedTensor, Sink
from .st_sink import SafetensorsSink

if TYPE_CHECKING:
    from quantd.engine.types import QuantizedTensor

# Methods whose results carry per-input-channel scales (AWQ not folded into a preceding layer): the
# library has no tensor for them.
CHANNEL_SCALE_METHODS = frozenset({"awq"})
# Methods whose affine zero points are floats (HQQ): the library stores integer zero points only.
FLOAT_ZERO_POINT_METHODS = frozenset({"hqq"})
_SUFFIX = ".weight"


def _module(name: str) -> str:
    return name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name


def _storage(scheme: Scheme) -> str:
    """The library's compression format for the scheme's weights."""
    info = DTYPES[scheme.dtype]
    if info.kind == "fp8":
        return "float-quantized"
    return "int-quantized" if info.bits == 8 else "pack-quantized"


def _scale_shape(shape: tuple[int, ...], scheme: Scheme) -> tuple[int, ...]:
    rows, cols = shape
    if scheme.granularity == "tensor":
        return (1,)
    if scheme.granularity == "channel":
        return (rows, 1)
    return (rows, cols // scheme.group_size)


def pack_rows_int32(offsets: torch.Tensor, bits: int) -> torch.Tensor:
    """``compressed_tensors``' ``pack_to_int32`` of the unsigned offsets ``[rows, cols]`` (values below
    ``2**bits``): each row a dense little-endian bitstream, zero-padded to whole int32 words."""
    from quantd.engine.packing import pack

    rows, cols = offsets.shape
    padded = -(-cols // 32) * 32  # 32 codes fill exactly ``bits`` words: rows stay word-aligned
    if padded != cols:
        offsets = torch.nn.functional.pad(offsets, (0, padded - cols))
    words = pack(offsets.to(torch.uint8).contiguous(), bits).view(torch.int32).reshape(rows, padded * bits // 32)
    return words[:, : math.ceil(cols * bits / 32)].contiguous()


@register
class CompressedTensors(OutputFormat):
    name = "compressed-tensors"
    suffix = ".safetensors"
    description = ("vLLM / transformers checkpoint (compressed-tensors pack-quantized, int-quantized and "
                   "float-quantized Linear weights; config.json gains quantization_config)")
    writes_config = True
    bits_from_encoding = True  # zero points packed at the codes' width, a row's codes in whole int32 words

    def select(self, info: TensorInfo, scheme: Scheme | None, reason: str | None,
               structure: ModelStructure) -> tuple[Scheme | None, str | None]:
        if scheme is None:
            return scheme, reason
        if structure.linear_weights is not None:
            if info.name not in structure.linear_weights:
                return None, "not a Linear weight of the model's architecture (compressed-tensors quantizes Linear weights)"
        elif len(info.shape) != 2 or not info.name.endswith(_SUFFIX):
            return None, "not a 2-D *.weight (compressed-tensors quantizes Linear weights)"
        if scheme.method == "gptq" and "static_groups" not in scheme.method_args:
            # compressed-tensors 0.20 and later load no ``weight_g_idx`` (its ``actorder: group`` is gone), so
            # act-order GPTQ keeps its groups contiguous here unless the config asks otherwise: the columns
            # are still visited by decreasing Hessian diagonal, and the checkpoint loads everywhere.
            scheme = scheme.model_copy(update={"method_args": {**scheme.method_args, "static_groups": True}})
        return scheme, reason

    def check(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> None:
        info = DTYPES[scheme.dtype]
        if len(shape) != 2:
            raise ConfigError(f"compressed-tensors holds 2-D Linear weights, not shape {list(shape)}",
                              tensor=name, field="shape")
        if info.kind == "int" and not info.signed:
            raise ConfigError(f"compressed-tensors stores signed integer codes: use int{info.bits} in place of "
                              f"{scheme.dtype} (the same grid with an affine zero point)", tensor=name,
                              field="scheme.dtype")
        if info.kind not in ("int", "fp8") or scheme.dtype == "fp8_e5m2":
            raise ConfigError(f"compressed-tensors cannot hold {scheme.dtype}: int2…int8 or fp8_e4m3",
                              tensor=name, field="scheme.dtype")
        from quantd.engine.methods import artifact_extras

        method: str = scheme.method
        zp_domain, _, channel_scale = artifact_extras(scheme, name=name)  # what the method's result carries
        if channel_scale or method in CHANNEL_SCALE_METHODS:
            raise ConfigError(f"method {method!r} leaves per-input-channel scales that compressed-tensors has no "
                              "tensor for; use the safetensors output", tensor=name, field="scheme.method")
        if (zp_domain == "float" or method in FLOAT_ZERO_POINT_METHODS) and not scheme.symmetric:
            raise ConfigError(f"method {method!r} gives float zero points; compressed-tensors stores integer ones: "
                              "use the safetensors output, or another method (rtn, gptq, awq)", tensor=name,
                              field="scheme.method")
        gran = granularity_of(scheme)
        axis = check_applicable(shape, gran, name=name)
        if scheme.granularity == "tensor" and info.kind == "int":
            raise ConfigError("compressed-tensors holds integer weights per channel or per group, not per tensor",
                              tensor=name, field="scheme.granularity")
        if scheme.granularity == "group" and info.kind == "fp8":
            raise ConfigError("compressed-tensors holds fp8 weights per channel or per tensor, not per group",
                              tensor=name, field="scheme.granularity")
        if scheme.granularity != "tensor" and axis != 0:
            raise ConfigError(f"compressed-tensors needs scales per output row (axis 0), not axis {scheme.axis}",
                              tensor=name, field="scheme.axis")

    def layout(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
        info = DTYPES[scheme.dtype]
        m = _module(name)
        rows, cols = shape
        sshape = _scale_shape(shape, scheme)
        if _storage(scheme) == "pack-quantized":
            out = [OutputTensor(f"{m}.weight_packed", "I32", (rows, math.ceil(cols * info.bits / 32)))]
        else:
            out = [OutputTensor(f"{m}.weight", info.storage, shape)]
        out.append(OutputTensor(f"{m}.weight_scale", SCALE_ST[scheme.scale_dtype], sshape))
        if info.kind == "int" and not scheme.symmetric:
            if info.bits < 8:
                zshape = (math.ceil(sshape[0] * info.bits / 32), sshape[1])
                out.append(OutputTensor(f"{m}.weight_zero_point", "I32", zshape))
            else:
                out.append(OutputTensor(f"{m}.weight_zero_point", "I8", sshape))
        if _storage(scheme) == "pack-quantized":
            out.append(OutputTensor(f"{m}.weight_shape", "I64", (2,)))
        return out

    def optional_layout(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
        """Tensors only some methods' results carry: the column order of act-order methods."""
        return [OutputTensor(f"{_module(name)}.weight_g_idx", "I32", (shape[1],))]

    def encode(self, qt: QuantizedTensor, name: str) -> dict[str, torch.Tensor]:
        info = DTYPES[qt.dtype]
        m = _module(name)
        if qt.scale is None:
            raise ValueError(f"tensor {name!r}: {qt.dtype} result has no scale")
        if qt.channel_scale is not None:
            raise ConfigError("a result with per-input-channel scales cannot be written as compressed-tensors",
                              tensor=name, field="scheme.method")
        if qt.zero_point is not None and qt.zero_point_domain != "int":
            raise ConfigError("compressed-tensors holds integer zero points, this result's are floats",
                              tensor=name, field="scheme.method")
        rows, cols = qt.shape
        sshape = (1,) if qt.granularity == "tensor" else (rows, 1) if qt.granularity == "channel" \
            else (rows, cols // qt.group_size)
        out: dict[str, torch.Tensor] = {}
        if info.kind == "int" and info.bits < 8:
            out[f"{m}.weight_packed"] = pack_rows_int32(qt.codes.to(torch.int16) - info.qmin, info.bits)
        elif info.kind == "int":
            out[f"{m}.weight"] = qt.codes.to(torch.int8)
        else:
            out[f"{m}.weight"] = qt.codes
        out[f"{m}.weight_scale"] = qt.scale.reshape(sshape)
        if qt.zero_point is not None:
            zp = qt.zero_point.reshape(sshape).to(torch.int16)
            if info.bits < 8:  # packed along the rows (the library's packed_dim=0)
                out[f"{m}.weight_zero_point"] = pack_rows_int32((zp - info.qmin).T.contiguous(), info.bits).T.contiguous()
            else:
                out[f"{m}.weight_zero_point"] = zp.to(torch.int8)
        if info.kind == "int" and info.bits < 8:
            out[f"{m}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        if qt.g_idx is not None:
            out[f"{m}.weight_g_idx"] = qt.g_idx.to(torch.int32)
        return out

    def open_sink(self, dst: str | os.PathLike[str], plans: Sequence[PlannedTensor], *,
                  extra_meta: Mapping[str, Any] | None = None) -> Sink:
        optional = [o for p in plans if p.scheme is not None
                    for o in self.optional_layout(p.info.name, p.info.shape, p.scheme)]
        return SafetensorsSink(dst, [o for p in plans for o in p.outputs], optional, metadata={"format": "pt"})

    def quantization_config(self, plans: Sequence[PlannedTensor], structure: ModelStructure, *,
                            written: Collection[str] = ()) -> dict[str, Any] | None:
        """``config.json``'s ``quantization_config``: one group per distinct weight scheme (with act-order
        when its modules carry ``weight_g_idx``), the Linear modules left in full precision under ``ignore``."""
        groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for p in plans:
            if p.scheme is None:
                continue
            m = _module(p.info.name)
            args = _weight_args(p.scheme, actorder=_actorder(p.scheme, g_idx=f"{m}.weight_g_idx" in written,
                                                           name=p.info.name))
            key = repr(sorted(args.items()))
            groups.setdefault(key, (args, []))[1].append(m)
        quantized = {m for _, mods in groups.values() for m in mods}
        known = structure.linear_weights
        linear = sorted(_module(p.info.name) for p in plans
                        if (p.info.name in known if known is not None
                            else p.info.name.endswith(_SUFFIX) and len(p.info.shape) == 2))
        ignore = [m for m in linear if m not in quantized]
        # Experts that transformers 5 merges into fused parameters are no Linear modules of the architecture,
        # but they are Linear modules of the checkpoint (and of loaders that read it expert by expert, as vLLM):
        # left in full precision, they are listed too.
        ignore += sorted(m for m in {_module(p.info.name) for p in plans if p.scheme is None
                                     and p.info.name.endswith(_SUFFIX) and len(p.info.shape) == 2
                                     and ".experts." in f".{p.info.name}"} if m not in linear)
        # Linear modules with no tensor of their own (a tied ``lm_head`` shares the embedding's) stay in full
        # precision: listed too, or a loader targeting the class would look for their quantized tensors.
        present = {_module(p.info.name) for p in plans}
        pre = f"{structure.base_prefix}." if structure.base_prefix else ""
        ignore += sorted(m for m in structure.linear_modules or ()
                         if m not in present and not (pre and {m.removeprefix(pre), pre + m} & present))
        # A base model's checkpoint (its names without the architecture's base_model_prefix, as
        # all-MiniLM-L6-v2's) is loaded under a prefix too: transformers' task classes put it under that prefix
        # (bert.encoder…), vLLM's embedding models under their own. Its modules are then named by patterns that
        # match the name under any prefix (the loaders take ``re:`` targets and ignores).
        base = structure.base_prefix
        bare = bool(base) and not any(p.info.name.startswith(f"{base}.") for p in plans)

        def named(m: str) -> str:
            return f"re:^(?:.*\\.)?{re.escape(m)}$" if bare else m

        by_class = structure.linear_weights is not None and len(groups) == 1
        config_groups = {}
        for i, (args, mods) in enumerate(groups.values()):
            fmt = args.pop("_format")
            config_groups[f"group_{i}"] = {"targets": ["Linear"] if by_class else sorted(map(named, mods)),
                                           "weights": args, "input_activations": None, "output_activations": None,
                                           "format": fmt}
        formats = {g["format"] for g in config_groups.values()}
        return {
            "quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed",
            "config_groups": config_groups,
            "ignore": [named(m) for m in ignore],
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
        }


def _actorder(scheme: Scheme, *, g_idx: bool, name: str) -> str | None:
    """The library's ``actorder`` of a weight: ``group`` when it carries ``weight_g_idx`` (readers that still
    know it: compressed-tensors before 0.20, vLLM), ``weight`` when act-order only set the order in which
    GPTQ visited the columns (contiguous groups), else None."""
    if g_idx:
        return "group"
    if scheme.method == "gptq":
        from quantd.engine.methods import get_method

        args = get_method("gptq", tensor=name).resolve_args(scheme, tensor=name)
        if args.get("act_order") and scheme.granularity == "group":
            return "weight"
    return None


def _weight_args(scheme: Scheme, *, actorder: str | None) -> dict[str, Any]:
    """The library's ``QuantizationArgs`` of a scheme (as it serialises them), plus its format."""
    info = DTYPES[scheme.dtype]
    asym = info.kind == "int" and not scheme.symmetric
    return {
        "num_bits": info.bits, "type": "float" if info.kind == "fp8" else "int", "symmetric": not asym,
        "strategy": scheme.granularity, "group_size": scheme.group_size if scheme.granularity == "group" else None,
        "block_structure": None, "dynamic": False, "actorder": actorder,
        "observer": None, "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": "torch.int8" if asym else None,
        "_format": _storage(scheme),
    }
