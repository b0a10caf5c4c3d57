"""A model directory's architecture without its weights, for model-aware calibration (CONTRACT §10).

The class ``config.json`` names is built by ``transformers`` with its parameters on the ``meta`` device
(never remote code, never code from the upload; ``auto_map`` is ignored), its repeated blocks found (the
longest ``nn.ModuleList`` of one class: ``model.layers``, ``encoder.layer``, ...), its parameters matched
to the checkpoint's tensors, and the places where AWQ's per-input-channel scales fold into the block picked.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantd.errors import ConfigError, MalformedInputError
from quantd_client import QuantConfig

from .calibration import CalibrationEntry

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


_BUILDING = threading.Lock()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules this thread builds inside get their parameters on ``meta`` (no memory, no initialisation)
    while their buffers (rotary frequencies, position ids) are computed for real. Other threads' modules
    are left alone; one build at a time patches ``register_parameter``."""
    with _BUILDING:
        register = nn.Module.register_parameter
        builder = threading.get_ident()

        def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(self, name, param)
            if param is not None and param.device.type != "meta" and threading.get_ident() == builder:
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


# config.json keys that count repeated parts (num_hidden_layers, n_layer, num_local_experts, ...) and keys that
# give a width every checkpoint of the architecture has as (or within a small factor of) a tensor dimension.
# Limits and thresholds named like counts build nothing (Qwen2's max_window_layers: 28 whatever the depth).
_COUNT_KEY = re.compile(r"(^|_)(layers?|experts?)$")
_NOT_COUNT_KEY = re.compile(r"^max_|window")
_WIDTH_KEYS = frozenset({"hidden_size", "intermediate_size", "vocab_size", "n_embd", "d_model", "n_inner", "ffn_dim",
                         "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size",
                         "num_attention_heads", "num_key_value_heads", "head_dim"})
# Buffers a model builds for itself (position ids, causal masks): beyond this, config.json is refused.
MAX_BUFFER_BYTES = 1 << 30


def _int_items(cfg: Mapping[str, Any], depth: int = 0) -> Iterator[tuple[str, int]]:
    for key, value in cfg.items():
        if isinstance(value, int) and not isinstance(value, bool):
            yield key, value
        elif isinstance(value, Mapping) and depth < 4:  # sub-configs: text_config, vision_config, ...
            yield from _int_items(value, depth + 1)


def check_declared_size(cfg: Mapping[str, Any], shapes: Iterable[tuple[int, ...]], *, rel: str = "config.json"
                        ) -> None:
    """Refuse (MalformedInputError) a ``config.json`` that describes a model far larger than the uploaded
    weights, before transformers builds it: each layer has at least one tensor, each expert one tensor or one
    index of a stacked tensor, and each width is within a small factor of some tensor dimension. Building an
    architecture costs time and memory in its size even on the meta device (a 220-byte config can declare a
    hundred thousand layers)."""
    dims = list(shapes)
    count, widest = len(dims), max((max(s) for s in dims if s), default=0)
    for key, value in _int_items(cfg):
        if _COUNT_KEY.search(key) and not _NOT_COUNT_KEY.search(key) \
                and value > max(count, widest if "expert" in key else 0, 1):
            raise MalformedInputError(f"{rel}: {key} is {value}, but the weight files hold {count} tensors: it "
                                      "does not describe them")
        if key in _WIDTH_KEYS and value > 4 * max(widest, 1):
            raise MalformedInputError(f"{rel}: {key} is {value}, far beyond every dimension of the weight files "
                                      f"(the largest is {widest}): it does not describe them")


def build_model(cfg: Mapping[str, Any], *, real_buffers: bool) -> nn.Module:
    """The architecture without weights: every parameter on ``meta``; buffers computed on the CPU when
    ``real_buffers`` (to run it), else on ``meta`` too (to look at its structure)."""
    with warnings.catch_warnings():  # notices of the modules transformers imports: not the user's concern
        warnings.simplefilter("ignore")
        cls, conf = architecture(cfg)

        def build(parameters_only: bool) -> nn.Module:
            try:
                with _parameters_on_meta() if parameters_only else torch.device("meta"):
                    return cls._from_config(conf)  # type: ignore[attr-defined, no-any-return]
            except Exception as e:
                raise _bad(f"config.json: transformers cannot build {cls.__name__} from it: {type(e).__name__}: "
                           f"{str(e)[:300]}") from None

        model = build(False)
        if real_buffers:  # its buffers computed on the CPU: their size first, from the meta build
            size = sum(b.numel() * b.element_size() for b in model.buffers())
            if size > MAX_BUFFER_BYTES:
                raise _bad(f"config.json: {cls.__name__} would build {size} bytes of buffers (position ids, masks), "
                           f"beyond the {MAX_BUFFER_BYTES} this server allows")
            model = build(True)
    if getattr(conf, "is_encoder_decoder", False):
        raise _bad(f"{cls.__name__} is an encoder-decoder model: JSONL calibration runs models with one stack of "
                   "blocks (decoders, encoders)")
    if "input_ids" not in inspect.signature(model.forward).parameters:
        raise _bad(f"{cls.__name__} does not take token ids (input_ids): JSONL calibration runs text models")
    model.eval()
    return model


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the longest ``nn.ModuleList`` whose modules are all of one class."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        repeated = isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1
        if repeated and (best is None or len(mod) > len(best[1])):
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
        width = {mods[c].in_features for c in consumers}
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


def apply_fold(block: nn.Module, fold: Fold, s: torch.Tensor) -> None:
    """Divide ``fold.source``'s output channels by ``s`` and multiply the consumers' input columns by ``s``
    (in place): the block computes the same function, its consumers' weights are ``W·s``."""
    source = block.get_submodule(fold.source)
    weight = source.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{fold.source} has no weight")
    weight.div_(s.unsqueeze(1) if isinstance(source, nn.Linear) else s)
    bias = getattr(source, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.div_(s)
    for c in fold.consumers:
        consumer = block.get_submodule(c)
        if not isinstance(consumer.weight, torch.Tensor):
            raise TypeError(f"{c} has no weight")
        consumer.weight.mul_(s.unsqueeze(0))


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
    renamings, converters = _load_conversions(model)
    renamed: dict[str, str] = {}  # transformers' load-time key renames, in its (sorted) order
    for t in sorted(tensor_names):
        new, converted = _renamed(t, renamings, converters)
        if converted:
            raise _bad(f"checkpoint tensor {t!r} is built by transformers from several checkpoint tensors or "
                       f"transformed as it loads ({type(model).__name__}: merged experts or fused projections); "
                       "model-aware calibration runs models whose parameters are checkpoint tensors: give "
                       "GPTQ/AWQ a calibration file of Hessians (the SDK's recorder), or use a data-free method")
        if renamed.setdefault(new, t) != t:
            raise _bad(f"checkpoint tensors {renamed[new]!r} and {t!r} both load as {new!r}")

    def resolve(n: str) -> str | None:
        for cand in (n, f"{prefix}.{n}" if prefix else n, n.removeprefix(f"{prefix}.") if prefix else n):
            if cand in tensor_names:
                return cand
            if cand in renamed:
                return renamed[cand]
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
            source = blocks[i].get_submodule(fold.source)
            kept = isinstance(source, nn.Linear) or all(  # a norm with the scales in it is written in float
                config.scheme_for(tensor_of[f"{prefix_i}.{fold.source}.{leaf}"], tuple(p.shape))[0] is None
                for leaf, p in source.named_parameters() if f"{prefix_i}.{fold.source}.{leaf}" in tensor_of)
            if kept and all(s is not None and s.method == "awq" for s in schemes) and \
                    all(s == schemes[0] for s in schemes):
                use.append(fold)
                folded.update(n for n in names if n is not None)
        folds[i] = use
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    return ModelPlan(model, blocks_name, blocks, tensor_of, linears, folds, frozenset(folded),
                     vocab if isinstance(vocab, int) else None)


def _load_conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """The key renamings and the tensor converters transformers applies to this model's checkpoint as it
    loads it (``embed_out`` → ``lm_head`` for GPT-NeoX, per-expert weights merged for MoE models); none where
    this transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    try:
        conversions = list(get_model_conversion_mapping(model))
    except Exception:  # a model class the mapping does not know: its checkpoint keys are its parameter names
        return [], []
    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)])


def _renamed(key: str, renamings: Sequence[Any], converters: Sequence[Any]) -> tuple[str, bool]:
    """The name transformers loads checkpoint tensor ``key`` as, and whether a converter transforms it; the
    key as it is where this transformers' loader API differs."""
    if not renamings and not converters:
        return key, False
    try:
        from transformers.core_model_loading import rename_source_key

        new, converter = rename_source_key(key, list(renamings), list(converters))
    except Exception:  # another transformers: its checkpoints' keys are taken as they are
        return key, False
    return str(new), converter is not None


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


