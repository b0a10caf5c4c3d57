"""Model-aware calibration (CONTRACT §10): a model directory quantized with GPTQ/AWQ while the worker runs
the model itself on a JSONL calibration part, one block at a time.

The architecture ``config.json`` names is built by ``transformers`` with its parameters on the ``meta``
device (never remote code, never code from the upload); its repeated blocks are the longest
``nn.ModuleList`` of one class (``model.layers``, ``encoder.layer``, ...). The calibration batch runs
through the modules before the blocks, and the first block's call is caught (its positional and keyword
arguments: attention mask, position embeddings, ...). Then, block after block, with only that block's
weights loaded from the shards (float32, on the worker's device):

1. the block runs on every batch with hooks on its Linear layers summing ``H = Σ x xᵀ`` over the real
   (unpadded) tokens;
2. with ``awq``, the per-input-channel scales are folded where the block allows it (:data:`FOLD_PATTERNS`):
   searched jointly for all consumers of one source, the source's output divided and the consumers' input
   columns multiplied, checked to leave the block's output unchanged;
3. each Linear is quantized with its scheme's method and written to its output shard;
4. the block runs again with the dequantized weights: its outputs are the next block's inputs, so every
   block is calibrated on what the quantized blocks before it produce.

Linear layers outside the blocks are calibrated where they run: before the blocks on the embeddings'
outputs, after them (an output head, a pooler) in a last pass that replays the final block's outputs
through the rest of the model. They are never folded (AWQ keeps ``channel_scale`` there). Memory on the
device: one block's weights (plus the modules outside the blocks while they run) and the calibration
activations, never the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantd.errors import ConfigError, JobCancelled, MalformedInputError
from quantd_client import Progress, QuantConfig, Report, Scheme, TensorReport

from .calibration import CalibrationEntry
from .formats import torch_dtype
from .model_dir import (
    CONFIG,
    ModelFiles,
    _fresh_dir,
    _open_shard,
    _read_json,
    _shard_tensors,
    _write_other_files,
    fmt_optional,
    output_relpath,
    plan_directory,
)
from .outputs import ModelStructure, OutputFormat, PlannedTensor, Sink, get_format
from .readers import ModelReader
from .text_calibration import CalibrationLine, load_tokenizer, pad_batch, read_jsonl, token_sequences

log = logging.getLogger("quantd.io")

# Sequences a forward pass takes at once.
BATCH_SEQUENCES = 8
# A fold must leave the block's output unchanged to this relative error (float32).
FOLD_TOLERANCE = 1e-3

# Where AWQ's per-input-channel scales fold (block-relative module names): a source whose output reaches
# exactly these consumers and is linear per channel in it. Pre-norm decoders (Llama, Mistral, Qwen...):
# the input norm feeds q/k/v, the post-attention norm gate/up; attention is linear in V; the gated MLP is
# linear in up. BERT-style encoders: attention is linear in V. (Their LayerNorms are the residual stream
# of a post-norm block: nothing folds into them.) A pattern applies only where every module exists, the
# shapes match and a norm multiplies by its weight; every fold is checked on the block's output.
FOLD_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
    ("attention.self.value", ("attention.output.dense",)),
)


def _bad(msg: str) -> ConfigError:
    return ConfigError(msg, field="calibration")


# --- the model's skeleton --------------------------------------------------------------------------------

@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on ``meta`` (no memory, no initialisation) while their
    buffers (rotary frequencies, position ids) are computed for real."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _implemented_architectures() -> set[str]:
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr in dir(modeling_auto):
        if attr.startswith("MODEL") and attr.endswith("_MAPPING_NAMES"):
            for v in getattr(modeling_auto, attr).values():
                names.update((v,) if isinstance(v, str) else v)
    return names


def architecture(cfg: Mapping[str, Any]) -> tuple[type[nn.Module], Any]:
    """The transformers class and config of ``config.json`` (ConfigError when transformers does not implement
    it). ``auto_map`` is ignored: remote code is never used; with no implemented class among
    ``architectures``, the model type's causal-LM or base class is taken."""
    try:
        import transformers
        from transformers.models.auto import modeling_auto
    except ImportError:
        raise _bad("JSONL calibration runs the model with transformers, which this server does not have") from None
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise _bad(f"config.json: model_type {model_type!r} is not an architecture transformers "
                   f"{transformers.__version__} implements (JSONL calibration runs the model)")
    conf = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                            if k not in ("model_type", "auto_map")})
    implemented = _implemented_architectures()
    archs = [a for a in cfg.get("architectures") or () if isinstance(a, str)]
    for name in archs:
        cls = getattr(transformers, name, None) if name in implemented else None
        if isinstance(cls, type):
            return cls, conf
    for table in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        name = table.get(model_type)
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type):
            return cls, conf
    raise _bad(f"config.json: architecture {archs or model_type!r} is not one transformers "
               f"{transformers.__version__} implements (JSONL calibration runs the model)")


def build_model(cfg: Mapping[str, Any], *, real_buffers: bool) -> nn.Module:
    """The architecture without weights: every parameter on ``meta``; buffers computed on the CPU when
    ``real_buffers`` (to run it), else on ``meta`` too (to look at its structure)."""
    cls, conf = architecture(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if real_buffers:
                with _parameters_on_meta():
                    model = cls._from_config(conf)  # type: ignore[attr-defined]
            else:
                with torch.device("meta"):
                    model = cls._from_config(conf)  # type: ignore[attr-defined]
        except Exception as e:
            raise _bad(f"config.json: transformers cannot build {cls.__name__} from it: {type(e).__name__}: "
                       f"{str(e)[:300]}") from None
    model.eval()
    return model


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the longest ``nn.ModuleList`` whose modules are all of one class."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise _bad(f"{type(model).__name__} has no list of repeated blocks to calibrate one at a time")
    return best


def _norm_scales_by_weight(norm: nn.Module, width: int) -> bool:
    """Whether ``norm(x)`` is ``n(x) · weight (+ bias)`` per channel, tried on a CPU copy: the condition for
    folding scales into its weight."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,) or any(True for _ in norm.children()):
        return False
    try:
        probe = copy.deepcopy(norm).to_empty(device="cpu").float()
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, width, generator=gen)
        w = torch.rand(width, generator=gen) + 0.5
        bias = getattr(probe, "bias", None)
        with torch.no_grad():
            probe.weight.fill_(1.0)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
            base = probe(x)
            probe.weight.copy_(w)
            if isinstance(bias, torch.Tensor):
                bias.fill_(0.25)
            got = probe(x)
        want = base * w + (0.25 if isinstance(bias, torch.Tensor) else 0.0)
        return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
    except Exception:  # a norm that cannot run on its own: no fold
        return False


@dataclass(frozen=True)
class Fold:
    """AWQ scales folded from ``consumers`` (Linear modules) into ``source`` (a norm or a Linear), names
    relative to the block."""

    source: str
    consumers: tuple[str, ...]


def block_folds(block: nn.Module) -> list[Fold]:
    """The :data:`FOLD_PATTERNS` that apply to ``block``."""
    mods = dict(block.named_modules())
    out = []
    for src, consumers in FOLD_PATTERNS:
        if src not in mods or not all(isinstance(mods.get(c), nn.Linear) for c in consumers):
            continue
        width = {mods[c].in_features for c in consumers}  # type: ignore[union-attr]
        if len(width) != 1:
            continue
        source = mods[src]
        if isinstance(source, nn.Linear):
            ok = source.out_features in width
        else:
            ok = _norm_scales_by_weight(source, width.pop())
        if ok:
            out.append(Fold(src, consumers))
    return out


@dataclass
class ModelPlan:
    """The model side of a calibration run: the skeleton, its blocks, checkpoint names, folds."""

    model: nn.Module
    blocks_name: str
    blocks: nn.ModuleList
    tensor_of: dict[str, str]  # the model's parameter name → the checkpoint's tensor name
    linears: dict[str, str]  # Linear module name → its weight's checkpoint tensor name
    folds: dict[int, list[Fold]]  # per block: the folds whose consumers are all quantized with awq
    folded: frozenset[str]  # checkpoint weight names whose AWQ scales fold
    vocab_size: int | None

    def block_prefix(self, i: int) -> str:
        return f"{self.blocks_name}.{i}" if self.blocks_name else str(i)


def plan_model(model: nn.Module, config: QuantConfig, tensor_names: Mapping[str, tuple[int, ...]]) -> ModelPlan:
    """Match the skeleton to the checkpoint's tensors (ConfigError when a parameter is missing) and pick
    the folds AWQ can use."""
    blocks_name, blocks = find_blocks(model)
    prefix = getattr(model, "base_model_prefix", "") or ""

    def resolve(n: str) -> str | None:
        for cand in (n, f"{prefix}.{n}" if prefix else n, n.removeprefix(f"{prefix}.") if prefix else n):
            if cand in tensor_names:
                return cand
        return None

    tensor_of: dict[str, str] = {}
    for n, _ in model.named_parameters(remove_duplicate=False):
        t = resolve(n)
        if t is not None:
            tensor_of[n] = t
    for n, _ in model.named_parameters():  # tied aliases share one: each group needs one in the checkpoint
        if n not in tensor_of and not _has_alias(model, n, tensor_of):
            raise _bad(f"the architecture's parameter {n!r} is in no weight file of the model directory "
                       f"({type(model).__name__} from config.json)")
    linears = {m: tensor_of[f"{m}.weight"] for m, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and f"{m}.weight" in tensor_of}
    folds: dict[int, list[Fold]] = {}
    folded: set[str] = set()
    candidates = block_folds(blocks[0]) if len(blocks) else []
    for i in range(len(blocks)):
        prefix_i = f"{blocks_name}.{i}"
        use = []
        for fold in candidates:
            names = [linears.get(f"{prefix_i}.{c}") for c in fold.consumers]
            if any(n is None for n in names):
                continue
            schemes = [config.scheme_for(n, tensor_names[n])[0] for n in names if n is not None]
            if all(s is not None and s.method == "awq" for s in schemes) and all(s == schemes[0] for s in schemes):
                use.append(fold)
                folded.update(n for n in names if n is not None)
        folds[i] = use
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    return ModelPlan(model, blocks_name, blocks, tensor_of, linears, folds, frozenset(folded),
                     vocab if isinstance(vocab, int) else None)


def _has_alias(model: nn.Module, name: str, tensor_of: Mapping[str, str]) -> bool:
    param = model.get_parameter(name)
    return any(p is param and n in tensor_of for n, p in model.named_parameters(remove_duplicate=False))


def calibration_index(plan: ModelPlan, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, CalibrationEntry]:
    """Every Linear of the model as the calibration file's index would name it: the plan then knows which
    weights will have calibration."""
    out = {}
    for weight in plan.linears.values():
        module = weight.removesuffix(".weight")
        out[module] = CalibrationEntry(module, tensors[weight][1] if len(tensors[weight]) == 2 else -1)
    return out


@dataclass(frozen=True)
class TextCalibrationPlan:
    """A JSONL-calibrated job, checked: the shards' plans, the model's structure and plan, the lines and the
    tokenizer (None without text lines)."""

    plans: dict[str, list[PlannedTensor]]
    structure: ModelStructure
    model: ModelPlan
    lines: list[CalibrationLine]
    tokenizer: Any


def plan_text_calibration(files: ModelFiles, config: QuantConfig, calibration: str | os.PathLike[str], *,
                          real_buffers: bool = False) -> TextCalibrationPlan:
    """Everything checked before a job with a JSONL calibration part is accepted (ConfigError, 422, naming
    what is wrong): the architecture, its parameters in the weight files, every line (token ids within the
    vocabulary), a tokenizer for text lines, and the plan of every tensor with the folds AWQ will use.
    ``real_buffers``: build the model to run it (see :func:`build_model`)."""
    if CONFIG not in files.files:
        raise _bad("JSONL calibration runs the model: the model directory needs its config.json")
    cfg = _read_json(files.files[CONFIG], CONFIG)
    if not isinstance(cfg, dict):
        raise MalformedInputError(f"{CONFIG}: not a JSON object")
    tensors = {t.name: t.shape for ts in _shard_tensors(files).values() for t in ts}
    mplan = plan_model(build_model(cfg, real_buffers=real_buffers), config, tensors)
    lines = read_jsonl(calibration, vocab_size=mplan.vocab_size)
    tokenizer = load_tokenizer(files.files) if any(cl.text is not None for cl in lines) else None
    plans, structure = plan_directory(files, config, calibration_index(mplan, tensors), folded=mplan.folded)
    return TextCalibrationPlan(plans, structure, mplan, lines, tokenizer)


# --- running it --------------------------------------------------------------------------------------------

class _Caught(Exception):
    """Raised by the catcher once it has the first block's arguments."""


class _Stand(nn.Module):
    """Stands in for a block: catches its call (``mode == "catch"``) or replays the final hidden states
    (``"replay"``, the first block) and passes them on (``"pass"``). Attributes the parent model reads off
    a block (``attention_type``, ...) come from the block it stands for."""

    def __init__(self, block: nn.Module, mode: str, owner: _Run) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_owner", owner)
        self.mode = mode

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        owner: _Run = object.__getattribute__(self, "_owner")
        if self.mode == "catch":
            owner.caught = (args, kwargs)
            raise _Caught
        hidden = owner.replay_hidden() if self.mode == "replay" else (args[0] if args else kwargs["hidden_states"])
        return (hidden,) if owner.tuple_out else hidden


@dataclass
class _Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: torch.Tensor  # bool [B, T]: the real tokens (the Hessians' rows)
    hidden: torch.Tensor | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    by_name: bool = False  # the hidden states came as the ``hidden_states`` keyword


class _Hessians:
    """Forward pre-hooks summing ``Σ x xᵀ`` (float32, on the device) of each hooked Linear's input rows,
    the current batch's real tokens only."""

    def __init__(self) -> None:
        self.h: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.tokens: torch.Tensor | None = None
        self._handles: list[Any] = []

    def hook(self, modules: Mapping[str, nn.Module]) -> None:
        for name, mod in modules.items():
            self._handles.append(mod.register_forward_pre_hook(self._make(name)))

    def _make(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            if self.tokens is not None and tuple(x.shape[:-1]) == tuple(self.tokens.shape):
                x = x[self.tokens]
            x = x.reshape(-1, x.shape[-1]).float()
            h = self.h.get(name)
            if h is None:
                h = self.h[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            h.addmm_(x.T, x)
            self.count[name] = self.count.get(name, 0) + x.shape[0]
        return pre

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Weights:
    """Loads a module's parameters from the shards onto the device (float32) and gives them back to
    ``meta``; counts the elements loaded at once (``peak``)."""

    def __init__(self, files: ModelFiles, where: Mapping[str, str], plan: ModelPlan, device: torch.device) -> None:
        self.files, self.where, self.plan, self.device = files, where, plan, device
        self._readers: dict[str, ModelReader] = {}
        self.live = self.peak = 0
        self._aliases: dict[int, list[str]] = {}
        for n, p in plan.model.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(id(p), []).append(n)

    def _reader(self, rel: str) -> ModelReader:
        if rel not in self._readers:
            self._readers[rel] = _open_shard(self.files, rel)
        return self._readers[rel]

    def _set(self, names: Sequence[str], value: torch.Tensor) -> None:
        param = nn.Parameter(value, requires_grad=False)
        for n in names:
            owner, _, leaf = n.rpartition(".")
            self.plan.model.get_submodule(owner)._parameters[leaf] = param

    def load(self, names: Sequence[str]) -> None:
        """The parameters ``names`` (and their tied aliases) onto the device."""
        model = self.plan.model
        for n in names:
            p = model.get_parameter(n)
            if p.device.type != "meta":
                continue
            aliases = self._aliases.get(id(p), [n])
            tensor = next((self.plan.tensor_of[a] for a in aliases if a in self.plan.tensor_of), None)
            if tensor is None:
                raise MalformedInputError(f"parameter {n!r} of the model is in no weight file")
            x = self._reader(self.where[tensor]).load(tensor, self.device).float()
            if tuple(x.shape) != tuple(p.shape):
                raise MalformedInputError(f"tensor {tensor!r} has shape {list(x.shape)}, the architecture's "
                                          f"{n!r} {list(p.shape)}", tensor=tensor)
            self._set(aliases, x)
            self.live += x.numel()
        self.peak = max(self.peak, self.live)

    def release(self, names: Sequence[str]) -> None:
        """The parameters ``names`` given back to ``meta``."""
        model = self.plan.model
        for n in names:
            p = model.get_parameter(n)
            if p.device.type == "meta":
                continue
            self.live -= p.numel()
            self._set(self._aliases.get(id(p), [n]), torch.empty_like(p, device="meta"))

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


def _call(block: nn.Module, b: _Batch, hidden: torch.Tensor) -> Any:
    if b.by_name:
        return block(*b.args, hidden_states=hidden, **b.kwargs)
    return block(hidden, *b.args, **b.kwargs)


def _hidden_of(out: Any) -> torch.Tensor:
    h = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(h, torch.Tensor):
        raise MalformedInputError(f"a block of the model returned {type(out).__name__}, not hidden states")
    return h


class _Run:
    """One model-aware calibration run: every Linear the plans quantize is quantized and written into its
    shard's sink (:meth:`run`); what is left is written by the caller."""

    def __init__(self, plan: ModelPlan, files: ModelFiles, where: Mapping[str, str],
                 plans: Mapping[str, PlannedTensor], sinks: Mapping[str, Sink], fmt: OutputFormat,
                 device: torch.device, on_tensor: Callable[[str], None], should_cancel: Callable[[], bool]) -> None:
        self.plan, self.plans, self.sinks, self.where, self.fmt = plan, plans, sinks, where, fmt
        self.device = device
        self.on_tensor, self.should_cancel = on_tensor, should_cancel
        self.weights = _Weights(files, where, plan, device)
        self.reports: dict[str, TensorReport] = {}
        self.written: set[str] = set()
        self.caught: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.tuple_out = False
        self._replay: torch.Tensor | None = None

    def replay_hidden(self) -> torch.Tensor:
        if self._replay is None:
            raise RuntimeError("no hidden states to replay")
        return self._replay

    def _load_outside(self, load: bool) -> None:
        """The parameters outside the blocks (embeddings, final norm, heads) loaded or given back."""
        blocks = self.plan.blocks_name + "."
        names = [n for n, _ in self.plan.model.named_parameters() if not n.startswith(blocks)]
        if load:
            self.weights.load(names)
        else:
            self.weights.release(names)

    def _linears_outside(self) -> dict[str, nn.Module]:
        blocks = self.plan.blocks_name + "."
        return {m: self.plan.model.get_submodule(m) for m in self.plan.linears if not m.startswith(blocks)}

    def run(self, batches: list[_Batch]) -> None:
        try:
            with torch.no_grad():
                self._run(batches)
        finally:
            self.weights.close()

    def _run(self, batches: list[_Batch]) -> None:
        blocks = self.plan.blocks
        self._load_outside(True)
        head = _Hessians()
        outside = self._linears_outside()
        head.hook(outside)
        try:
            self._catch(batches, head)
        finally:
            head.remove()
        first = {m: n for m, n in head.count.items() if n > 0}
        if first:  # Linear layers before the blocks: quantized on their own inputs, then the catch redone
            self._quantize({m: outside[m] for m in first}, head, folded=False)
            self._catch(batches, None)
        self._load_outside(False)
        for i in range(len(blocks)):
            if self.should_cancel():
                raise JobCancelled(f"cancelled at block {i} of {len(blocks)}")
            self._block(i, batches)
        rest = {m: mod for m, mod in outside.items() if m not in first and self._wanted(m)}
        if rest:
            self._tail(batches, rest)

    def _wanted(self, module: str) -> bool:
        p = self.plans.get(self.plan.linears[module])
        return p is not None and p.scheme is not None

    def _catch(self, batches: list[_Batch], hessians: _Hessians | None) -> None:
        blocks = self.plan.blocks
        first = blocks[0]
        blocks[0] = _Stand(first, "catch", self)
        try:
            for b in batches:
                if hessians is not None:
                    hessians.tokens = b.tokens
                self.caught = None
                with contextlib.suppress(_Caught):
                    self.plan.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
                if self.caught is None:
                    raise MalformedInputError(f"{type(self.plan.model).__name__} never reached its first block")
                args, kwargs = self.caught
                kwargs = dict(kwargs)
                if args:
                    b.hidden, b.args, b.by_name = args[0], tuple(args[1:]), False
                else:
                    b.hidden, b.by_name = kwargs.pop("hidden_states"), True
                b.kwargs = kwargs
        finally:
            blocks[0] = first

    def _block(self, i: int, batches: list[_Batch]) -> None:
        prefix = self.plan.block_prefix(i)
        block = self.plan.blocks[i]
        names = [n for n, _ in block.named_parameters(prefix=prefix)]
        self.weights.load(names)
        try:
            linears = {f"{prefix}.{n}": m for n, m in block.named_modules() if isinstance(m, nn.Linear)
                       and f"{prefix}.{n}" in self.plan.linears}
            hess = _Hessians()
            hess.hook({m: mod for m, mod in linears.items() if self._wanted(m)})
            reference = None
            try:
                for j, b in enumerate(batches):
                    hess.tokens = b.tokens
                    out = _call(block, b, self._hidden(b))
                    self.tuple_out = isinstance(out, (tuple, list))
                    if j == 0:
                        reference = _hidden_of(out)
            finally:
                hess.remove()
            folds = self.plan.folds.get(i, [])
            if folds and reference is not None:
                self._fold(prefix, block, folds, hess, batches[0], reference)
            self._quantize({m: mod for m, mod in linears.items() if self._wanted(m)}, hess, folded=True)
            for b in batches:
                b.hidden = _hidden_of(_call(block, b, self._hidden(b)))
        finally:
            self.weights.release(names)

    @staticmethod
    def _hidden(b: _Batch) -> torch.Tensor:
        if b.hidden is None:
            raise RuntimeError("no hidden states for the batch")
        return b.hidden

    def _fold(self, prefix: str, block: nn.Module, folds: Sequence[Fold], hess: _Hessians, b0: _Batch,
              reference: torch.Tensor) -> None:
        from quantd.engine.awq_fold import joint_scales
        from quantd.engine.methods import get_method

        for fold in folds:
            names = [f"{prefix}.{c}" for c in fold.consumers]
            if any(hess.count.get(n, 0) == 0 for n in names):
                raise MalformedInputError(f"module {names[0]!r} saw no calibration tokens")
            weight = self.plan.linears[names[0]]
            scheme = self._scheme(weight)
            args = get_method("awq").resolve_args(scheme, tensor=weight)
            consumers = [block.get_submodule(c) for c in fold.consumers]
            h = hess.h[names[0]]
            s = joint_scales([c.weight for c in consumers], h, hess.count[names[0]], scheme, args=args, name=weight)
            source = block.get_submodule(fold.source)
            if isinstance(source, nn.Linear):
                source.weight.div_(s.unsqueeze(1))
            else:
                source.weight.div_(s)
            bias = getattr(source, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.div_(s)
            for name, c in zip(names, consumers, strict=True):
                c.weight.mul_(s.unsqueeze(0))
                hess.h[name] = hess.h[name] / s.unsqueeze(0) / s.unsqueeze(1)
            self._write_float(f"{prefix}.{fold.source}", source)
        got = _hidden_of(_call(block, b0, self._hidden(b0)))
        err = float((got - reference).norm() / reference.norm().clamp_min(1e-30))
        if not err <= FOLD_TOLERANCE:
            raise MalformedInputError(f"folding AWQ scales into block {prefix!r} changed its output (relative "
                                      f"error {err:.2e}): this architecture's block is not the shape "
                                      f"{[f.source for f in folds]} folds assume")

    def _scheme(self, weight: str) -> Scheme:
        p = self.plans[weight]
        if p.scheme is None:
            raise RuntimeError(f"{weight!r} is not quantized")
        return p.scheme

    def _write_float(self, module: str, mod: nn.Module) -> None:
        """A folded source's parameters that are not quantized, written as they now are (in their dtype)."""
        for leaf, p in mod.named_parameters(recurse=False):
            tensor = self.plan.tensor_of.get(f"{module}.{leaf}")
            if tensor is None:
                continue
            planned = self.plans[tensor]
            if planned.scheme is not None:  # quantized (the folded V or up projection): written as such
                continue
            self.sinks[self.where[tensor]].write(tensor, p.detach().to("cpu", torch_dtype(planned.info.dtype)))
            self.written.add(tensor)
            self.on_tensor(tensor)

    def _quantize(self, modules: Mapping[str, nn.Module], hess: _Hessians, *, folded: bool) -> None:
        from quantd.engine.awq_fold import quantize_folded
        from quantd.engine.methods import LayerHessian, get_method, output_rel_error, quantize_tensor
        from quantd.engine.primitives import dequantize
        from quantd.engine.stats import quantized_error_stats

        for m, mod in modules.items():
            weight = self.plan.linears[m]
            p = self.plans[weight]
            scheme = self._scheme(weight)
            n = hess.count.get(m, 0)
            if n == 0:
                raise MalformedInputError(f"module {m!r} saw no calibration tokens: the model never ran it",
                                          tensor=weight)
            h = hess.h[m]
            w = mod.weight.detach()
            orig = torch_dtype(p.info.dtype)
            if folded and weight in self.plan.folded:
                args = get_method("awq").resolve_args(scheme, tensor=weight)
                qt = quantize_folded(w, h, scheme, args=args, name=weight, orig_dtype=orig)
            else:
                qt = dataclasses.replace(quantize_tensor(w, scheme, name=weight, calibration=LayerHessian(h, n)),
                                         orig_dtype=orig)
            stats = quantized_error_stats(w, qt)
            stats = stats.model_copy(update={"output_rel_error": output_rel_error(w, qt, h)})
            sink = self.sinks[self.where[weight]]
            for out_name, t in self.fmt.encode(qt, weight).items():
                sink.write(out_name, t)
            self.written.add(weight)
            self.reports[weight] = TensorReport(name=weight, shape=list(p.info.shape), in_dtype=p.info.dtype,
                                                scheme=scheme, stats=stats, skipped=False)
            mod.weight.copy_(dequantize(qt).to(w.dtype))
            self.on_tensor(weight)

    def _tail(self, batches: list[_Batch], rest: Mapping[str, nn.Module]) -> None:
        """The Linear layers after the blocks: the final hidden states replayed through the rest."""
        blocks = self.plan.blocks
        originals = list(blocks)
        for k in range(len(blocks)):
            blocks[k] = _Stand(originals[k], "replay" if k == 0 else "pass", self)
        self._load_outside(True)
        hess = _Hessians()
        hess.hook(rest)
        try:
            for b in batches:
                hess.tokens = b.tokens
                self._replay = b.hidden
                self.plan.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
        finally:
            hess.remove()
            self._replay = None
            for k, orig in enumerate(originals):
                blocks[k] = orig
        try:
            self._quantize(rest, hess, folded=False)
        finally:
            self._load_outside(False)


def _batches(seqs: Sequence[torch.Tensor], pad_id: int, device: torch.device) -> list[_Batch]:
    order = sorted(range(len(seqs)), key=lambda k: -int(seqs[k].numel()))  # similar lengths pad little
    out = []
    for k in range(0, len(order), BATCH_SEQUENCES):
        ids, mask = pad_batch([seqs[j] for j in order[k:k + BATCH_SEQUENCES]], pad_id)
        out.append(_Batch(ids.to(device), mask.to(device), mask.bool().to(device)))
    return out


def quantize_with_text_calibration(files: ModelFiles, dst: str | os.PathLike[str], config: QuantConfig, *,
                                   device: str | torch.device, calibration: str | os.PathLike[str],
                                   job_id: str | None = None,
                                   on_progress: Callable[[Progress], None] | None = None,
                                   should_cancel: Callable[[], bool] | None = None) -> Report:
    """Quantize the model directory ``files`` into ``dst`` (as :func:`quantize_directory` does), the
    calibrated methods' inputs captured by running the model on the JSONL ``calibration`` lines."""
    from quantd_client._schemas import CalibrationSpec

    from .pipeline import summarize

    t0 = time.perf_counter()
    dev = torch.device(device)
    fmt = get_format(config.output)
    checked = plan_text_calibration(files, config, calibration, real_buffers=True)
    plans, mplan = checked.plans, checked.model
    spec = config.calibration or CalibrationSpec()
    seqs = token_sequences(checked.lines, checked.tokenizer, samples=spec.samples, max_seq_len=spec.max_seq_len)
    cfg = mplan.model.config
    pad = getattr(checked.tokenizer, "pad_token_id", None)
    if not isinstance(pad, int):
        pad = getattr(cfg, "pad_token_id", None)
    batches = _batches(seqs, pad if isinstance(pad, int) else 0, dev)
    for n, b in list(mplan.model.named_buffers()):  # the parameters stay on meta until their module runs
        owner, _, leaf = n.rpartition(".")
        mplan.model.get_submodule(owner)._buffers[leaf] = b.to(dev)

    where = {p.info.name: rel for rel, ps in plans.items() for p in ps}
    by_name = {p.info.name: p for ps in plans.values() for p in ps}
    everything = [p for ps in plans.values() for p in ps]
    total_bytes = sum(p.info.nbytes for p in everything)
    state = {"tensors": 0, "bytes": 0}

    def tick(name: str) -> None:
        state["tensors"] += 1
        state["bytes"] += by_name[name].info.nbytes
        if on_progress is not None:
            on_progress(Progress(tensors_done=state["tensors"], tensors_total=len(everything),
                                 bytes_done=state["bytes"], bytes_total=total_bytes,
                                 fraction=state["bytes"] / total_bytes if total_bytes
                                 else state["tensors"] / len(everything)))

    if on_progress is not None:
        on_progress(Progress(tensors_total=len(everything), bytes_total=total_bytes))
    dst_path = Path(dst)
    stage = _fresh_dir(dst_path)
    try:
        with contextlib.ExitStack() as stack:
            sinks: dict[str, Sink] = {}
            for rel, ps in plans.items():
                target = stage / output_relpath(rel)
                target.parent.mkdir(parents=True, exist_ok=True)
                sinks[rel] = stack.enter_context(fmt.open_sink(target, ps))
            run = _Run(mplan, files, where, by_name, sinks, fmt, dev, tick, should_cancel or (lambda: False))
            run.run(batches)
            log.info("model-aware calibration: %d tensors quantized, at most %d parameters loaded at once",
                     len(run.reports), run.weights.peak)
            reports, written, weight_map = _write_rest(files, plans, sinks, fmt, dev, run, tick)
        _write_other_files(files, stage, fmt.quantization_config(everything, checked.structure, written=written),
                           weight_map, writes_config=fmt.writes_config)
        summary = summarize(everything, reports, files.total_bytes,
                            sum(p.stat().st_size for p in stage.rglob("*") if p.is_file()),
                            time.perf_counter() - t0, dev)
        if dst_path.exists():
            dst_path.rmdir()
        os.replace(stage, dst_path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return Report(job_id=job_id, config=config, summary=summary, tensors=reports)


def _write_rest(files: ModelFiles, plans: Mapping[str, Sequence[PlannedTensor]], sinks: Mapping[str, Sink],
                fmt: OutputFormat, dev: torch.device, run: _Run, tick: Callable[[str], None]
                ) -> tuple[list[TensorReport], set[str], dict[str, str]]:
    """Every tensor the run did not write (kept as they are, or quantized by methods without calibration),
    each shard finished; the reports in the shards' order, the output names written and the weight map."""
    from quantd.engine.methods import get_method

    from .pipeline import _process

    reports: list[TensorReport] = []
    written: set[str] = set()
    weight_map: dict[str, str] = {}
    for rel, ps in plans.items():
        sink = sinks[rel]
        with _open_shard(files, rel) as reader:
            for p in ps:
                name = p.info.name
                if name in run.reports:
                    reports.append(run.reports[name])
                elif name in run.written:  # a folded norm: kept in float, with the scales in it
                    reports.append(TensorReport(name=name, shape=list(p.info.shape), in_dtype=p.info.dtype,
                                                scheme=None, stats=None, skipped=True, reason=p.reason))
                else:
                    if p.scheme is not None and get_method(p.scheme.method).needs != "none":
                        raise MalformedInputError(f"tensor {name!r} is not the weight of a Linear layer the model "
                                                  "runs: it has no calibration", tensor=name)
                    reports.append(_process(reader, sink, fmt, p, dev, None))
                    tick(name)
        was_written = getattr(sink, "written", None)
        names = [o.name for p in ps for o in p.outputs]
        names += [o for o in fmt_optional(fmt, ps) if was_written is not None and was_written(o)]
        written.update(names)
        weight_map.update(dict.fromkeys(names, output_relpath(rel)))
        sink.finish(None)
    return reports, written, weight_map
