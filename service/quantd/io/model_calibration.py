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
2. with ``awq``, the per-input-channel scales are folded where the block allows it
   (:data:`quantd.io.model_skeleton.FOLD_PATTERNS`):
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
import dataclasses
import inspect
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantd.errors import ConfigError, JobCancelled, MalformedInputError
from quantd_client import Progress, QuantConfig, Report, Scheme, TensorReport

from .formats import torch_dtype
from .model_dir import (
    CONFIG,
    ModelFiles,
    _fresh_dir,
    _open_shard,
    _read_json,
    _shard_tensors,
    finish_stage,
    fmt_optional,
    output_relpath,
    plan_directory,
)
from .model_skeleton import (
    Fold,
    ModelPlan,
    apply_fold,
    build_model,
    calibration_index,
    check_declared_size,
    plan_model,
)
from .outputs import ModelStructure, OutputFormat, PlannedTensor, Sink, get_format
from .readers import ModelReader
from .text_calibration import CalibrationLine, load_tokenizer, pad_batch, read_jsonl, token_sequences

log = logging.getLogger("quantd.io")

# Sequences a forward pass takes at once.
BATCH_SEQUENCES = 8
# A fold must leave the block's output unchanged to this relative error (float32).
FOLD_TOLERANCE = 1e-3


def _bad(msg: str) -> ConfigError:
    return ConfigError(msg, field="calibration")


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
    check_declared_size(cfg, tensors.values())
    mplan = plan_model(build_model(cfg, real_buffers=real_buffers), config, tensors)
    lines = read_jsonl(calibration, vocab_size=mplan.vocab_size)
    tokenizer = load_tokenizer(files.files) if any(cl.text is not None for cl in lines) else None
    try:
        plans, structure = plan_directory(files, config, calibration_index(mplan, tensors), folded=mplan.folded)
    except ConfigError as e:  # an AWQ weight whose scales cannot fold: say why and what to do
        weight = e.tensor if e.field == "scheme.method" else None
        scheme = config.scheme_for(weight, tensors[weight])[0] if weight in tensors else None
        if weight in mplan.linears.values() and weight not in mplan.folded and scheme is not None \
                and scheme.method == "awq":
            e.detail = (f"{e.detail} (model-aware calibration found no layer before this weight that its AWQ "
                        "scales fold into exactly: none, a norm that does not multiply by its weight, or one shared "
                        "with weights of another scheme or head layout; quantize it with gptq through a rule, or "
                        "skip it)")
            e.args = (e.detail,)
        raise
    return TextCalibrationPlan(plans, structure, mplan, lines, tokenizer)


# --- running it ----------------------------------------------------------------------------------------------

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


_EXPERT = re.compile(r"\.experts\.\d+\.")  # a mixture's expert: fed the tokens its router picked


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
        routed = _EXPERT.search(name) is not None

        def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            if self.tokens is not None and tuple(x.shape[:-1]) == tuple(self.tokens.shape):
                x = x[self.tokens]
            elif self.tokens is not None and x.dim() == 2 and x.shape[0] == self.tokens.numel() and not routed:
                # the batch's positions flattened row-major (OPT's MLP input); a routed expert's rows are the
                # tokens sent to it, in the router's order, whatever their count
                x = x[self.tokens.reshape(-1)]
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
        groups: dict[int, list[str]] = {}  # tied parameters (one object under several names), by name
        for n, p in plan.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(n)
        self._aliases = {n: names for names in groups.values() for n in names}

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
            aliases = self._aliases.get(n, [n])
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
            self._set(self._aliases.get(n, [n]), torch.empty_like(p, device="meta"))

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

    @contextlib.contextmanager
    def _outside(self) -> Iterator[None]:
        """The modules outside the blocks for one pass: the small ones loaded now, Linear and Embedding layers
        (the embedding table, the output head) only when they run; every one given back at the end."""
        model, prefix = self.plan.model, self.plan.blocks_name + "."
        eager: list[str] = []
        handles = []
        for name, mod in model.named_modules():
            if name == self.plan.blocks_name or name.startswith(prefix):
                continue
            own = [f"{name}.{leaf}" if name else leaf for leaf, _ in mod.named_parameters(recurse=False)]
            if not own:
                continue
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                handles.append(mod.register_forward_pre_hook(
                    lambda m, args, names=own: self.weights.load(names)))
            else:
                eager += own
        self.weights.load(eager)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self.weights.release([n for n, _ in model.named_parameters() if not n.startswith(prefix)])

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
        outside = self._linears_outside()
        with self._outside():
            head = _Hessians()
            head.hook(outside)
            try:
                self._catch(batches, head)
            finally:
                head.remove()
            first = {m: n for m, n in head.count.items() if n > 0}
            if first:  # Linear layers before the blocks: quantized on their own inputs, then the catch redone
                self._quantize({m: outside[m] for m in first}, head, folded=False)
                self._catch(batches, None)
        for i in range(len(blocks)):
            if self.should_cancel():
                raise JobCancelled(f"cancelled at block {i} of {len(blocks)}")
            self._block(i, batches)
        rest = {m: mod for m, mod in outside.items() if m not in first and self._wanted(m)}
        if rest:
            self._tail(batches, rest)

    def _forward(self, b: _Batch, *, replay: bool = False) -> None:
        """The whole model on one batch (its blocks stood in for), without a key/value cache. A replay, whose
        first block ignores what it is given, feeds zero embeddings: the embedding table is not loaded."""
        model = self.plan.model
        params = inspect.signature(model.forward).parameters
        extra: dict[str, Any] = {"use_cache": False} if "use_cache" in params else {}
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        width = getattr(emb, "embedding_dim", None)
        if replay and "inputs_embeds" in params and isinstance(width, int):
            extra["inputs_embeds"] = torch.zeros(*b.input_ids.shape, width, device=b.input_ids.device)
        else:
            extra["input_ids"] = b.input_ids
        model(attention_mask=b.attention_mask, **extra)

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
                    self._forward(b)
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
            apply_fold(block, fold, s)
            for name in names:  # the consumers' inputs are divided by s
                hess.h[name] = hess.h[name] / s.unsqueeze(0) / s.unsqueeze(1)
            self._write_float(f"{prefix}.{fold.source}", block.get_submodule(fold.source))
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
        from quantd.engine.methods import LayerHessian, get_method, quantize_tensor
        from quantd.engine.primitives import dequantize

        for m, mod in modules.items():
            weight = self.plan.linears[m]
            p = self.plans[weight]
            scheme = self._scheme(weight)
            n = hess.count.get(m, 0)
            w = mod.weight.detach()
            orig = torch_dtype(p.info.dtype)
            if n == 0 and get_method(scheme.method).needs == "none":  # never run: a method without calibration
                qt = dataclasses.replace(quantize_tensor(w, scheme, name=weight), orig_dtype=orig)
                self._store(weight, p, scheme, w, qt, None)
                mod.weight.copy_(dequantize(qt).to(w.dtype))
                continue
            if n == 0:
                raise MalformedInputError(f"module {m!r} saw no calibration tokens: the model never ran it",
                                          tensor=weight)
            h = hess.h[m]
            if folded and weight in self.plan.folded:
                args = get_method("awq").resolve_args(scheme, tensor=weight)
                qt = quantize_folded(w, h, scheme, args=args, name=weight, orig_dtype=orig)
            else:
                qt = dataclasses.replace(quantize_tensor(w, scheme, name=weight, calibration=LayerHessian(h, n)),
                                         orig_dtype=orig)
            self._store(weight, p, scheme, w, qt, h)
            mod.weight.copy_(dequantize(qt).to(w.dtype))

    def _store(self, weight: str, p: PlannedTensor, scheme: Scheme, w: torch.Tensor, qt: Any,
               h: torch.Tensor | None) -> None:
        """One quantized weight measured (its output error through ``h``), written to its shard, reported."""
        from quantd.engine.methods import output_rel_error
        from quantd.engine.stats import quantized_error_stats

        stats = quantized_error_stats(w, qt)
        if h is not None:
            stats = stats.model_copy(update={"output_rel_error": output_rel_error(w, qt, h)})
        from .pipeline import write_encoded

        stats = write_encoded(self.fmt, self.sinks[self.where[weight]], qt, weight, stats)
        self.written.add(weight)
        self.reports[weight] = TensorReport(name=weight, shape=list(p.info.shape), in_dtype=p.info.dtype,
                                            scheme=scheme, stats=stats, skipped=False)
        self.on_tensor(weight)

    def _tail(self, batches: list[_Batch], rest: Mapping[str, nn.Module]) -> None:
        """The Linear layers after the blocks: the final hidden states replayed through the rest."""
        blocks = self.plan.blocks
        originals = list(blocks)
        for k in range(len(blocks)):
            blocks[k] = _Stand(originals[k], "replay" if k == 0 else "pass", self)
        with self._outside():
            hess = _Hessians()
            hess.hook(rest)
            try:
                for b in batches:
                    hess.tokens = b.tokens
                    self._replay = b.hidden
                    self._forward(b, replay=True)
            finally:
                hess.remove()
                self._replay = None
                for k, orig in enumerate(originals):
                    blocks[k] = orig
            self._quantize(rest, hess, folded=False)


def _batches(seqs: Sequence[torch.Tensor], pad_id: int, device: torch.device) -> list[_Batch]:
    order = sorted(range(len(seqs)), key=lambda k: -int(seqs[k].numel()))  # similar lengths pad little
    out = []
    for k in range(0, len(order), BATCH_SEQUENCES):
        ids, mask = pad_batch([seqs[j] for j in order[k:k + BATCH_SEQUENCES]], pad_id)
        out.append(_Batch(ids.to(device), mask.to(device), mask.bool().to(device)))
    return out


def sequence_limit(cfg: Any, max_seq_len: int) -> int:
    """``max_seq_len``, at most the model's positions (``max_position_embeddings``): a longer line runs past
    the position table (an error in the model's forward), so texts and token ids are cut there, as a
    tokenizer cuts them at ``max_seq_len``."""
    positions = getattr(cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
        return min(max_seq_len, positions)
    return max_seq_len


def quantize_with_text_calibration(files: ModelFiles, dst: str | os.PathLike[str], config: QuantConfig, *,
                                   device: str | torch.device, calibration: str | os.PathLike[str],
                                   job_id: str | None = None,
                                   on_progress: Callable[[Progress], None] | None = None,
                                   should_cancel: Callable[[], bool] | None = None) -> Report:
    """Quantize the model directory ``files`` into ``dst`` (as :func:`quantize_directory` does), the
    calibrated methods' inputs captured by running the model on the JSONL ``calibration`` lines."""
    from quantd_client._schemas import CalibrationSpec

    t0 = time.perf_counter()
    dev = torch.device(device)
    fmt = get_format(config.output)
    checked = plan_text_calibration(files, config, calibration, real_buffers=True)
    plans, mplan = checked.plans, checked.model
    spec = config.calibration or CalibrationSpec()
    cfg = mplan.model.config
    seqs = token_sequences(checked.lines, checked.tokenizer, samples=spec.samples,
                           max_seq_len=sequence_limit(cfg, spec.max_seq_len))
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
        summary = finish_stage(files, stage, dst_path, fmt, everything, checked.structure, reports, written,
                               weight_map, t0=t0, dev=dev)
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
