"""A JSONL calibration part (CONTRACT §10): one JSON object a line, ``{"text": "..."}`` or
``{"input_ids": [...]}``, that the worker runs through the model (:mod:`quantd.io.model_calibration`).

It is told from a safetensors calibration file by its content: its first bytes, after blanks and a UTF-8
byte order mark, are ``{`` and it has no NUL byte (a safetensors file starts with a little-endian header
length, whose upper bytes are zero); a blank file is JSONL without lines. Parsing is bounded: at most :data:`MAX_LINES` lines of at most
:data:`MAX_LINE_BYTES` bytes, and every problem names its line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantd.errors import ConfigError

MAX_LINE_BYTES = 1 << 20
MAX_LINES = 1 << 16
_SNIFF = 4096
_BOM = b"\xef\xbb\xbf"

# The files of a model directory that a tokenizer may need (copied beside config.json to load it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "generation_config.json", "chat_template.jinja")
# Those of them that hold a vocabulary: without one there is no tokenizer.
_VOCABULARIES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                 "sentencepiece.bpe.model")


def _bad(msg: str) -> ConfigError:
    return ConfigError(msg, field="calibration")


def is_jsonl(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` looks like JSONL (by content, not name)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
        whole = not f.read(1)
    if b"\0" in head:
        return False
    body = head.removeprefix(_BOM).lstrip(b" \t\r\n")
    return body.startswith(b"{") or (whole and not body)  # blank: JSONL without lines (refused as such)


@dataclass(frozen=True)
class CalibrationLine:
    """One line of the file: its number (1-based) and its text or token ids."""

    line: int
    text: str | None = None
    input_ids: tuple[int, ...] | None = None


def _parse(raw: bytes, n: int, vocab_size: int | None) -> CalibrationLine:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"calibration line {n}: not JSON ({e})") from None
    except RecursionError:
        raise _bad(f"calibration line {n}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise _bad(f"calibration line {n}: a JSON object with \"text\" or \"input_ids\", got {type(obj).__name__}")
    keys = set(obj)
    if keys - {"text", "input_ids"}:
        raise _bad(f"calibration line {n}: unknown keys {sorted(keys - {'text', 'input_ids'})} (a line holds "
                   f"\"text\" or \"input_ids\")")
    if len(keys) != 1:
        raise _bad(f"calibration line {n}: exactly one of \"text\" or \"input_ids\", got {sorted(keys) or 'none'}")
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise _bad(f"calibration line {n}: \"text\" must be a non-empty string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON's \ud800 escape with no pair: no tokenizer takes it
            raise _bad(f"calibration line {n}: \"text\" is not valid Unicode (a lone surrogate)") from None
        return CalibrationLine(n, text=text)
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise _bad(f"calibration line {n}: \"input_ids\" must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise _bad(f"calibration line {n}: input_ids[{i}] is not an integer: {t!r}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise _bad(f"calibration line {n}: token id {t} (input_ids[{i}]) is outside the model's vocabulary "
                       f"of {vocab_size} tokens" if vocab_size is not None else
                       f"calibration line {n}: token id {t} (input_ids[{i}]) is negative")
    return CalibrationLine(n, input_ids=tuple(ids))


def read_jsonl(path: str | os.PathLike[str], *, vocab_size: int | None = None) -> list[CalibrationLine]:
    """Every line of the file, checked (ConfigError naming the line); blank lines are skipped."""
    out: list[CalibrationLine] = []
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                raise _bad(f"calibration line {n}: longer than {MAX_LINE_BYTES} bytes")
            if n == 1:
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue
            if len(out) >= MAX_LINES:
                raise _bad(f"calibration file: more than {MAX_LINES} lines")
            out.append(_parse(raw, n, vocab_size))
    if not out:
        raise _bad("calibration file: no lines (JSONL with one {\"text\": ...} or {\"input_ids\": [...]} a line)")
    return out


def has_tokenizer(files: Mapping[str, Path]) -> bool:
    """Whether the model directory's top level holds a vocabulary a tokenizer can be built from."""
    return any(name in files for name in _VOCABULARIES)


@contextmanager
def tokenizer_dir(files: Mapping[str, Path]) -> Iterator[Path]:
    """A scratch directory with the model directory's ``config.json`` and tokenizer files (they may be
    stored under other names, as uploads are)."""
    tmp = Path(tempfile.mkdtemp(prefix="quantd-tokenizer-"))
    try:
        for name in ("config.json", *TOKENIZER_FILES):
            if name in files:
                shutil.copyfile(files[name], tmp / name)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(files: Mapping[str, Path]) -> Any:
    """The model directory's tokenizer (``AutoTokenizer``, never with remote code); ConfigError when it
    cannot be built."""
    import transformers

    if not has_tokenizer(files):
        raise _bad("calibration lines with \"text\" need a tokenizer in the model directory (tokenizer.json, "
                   "vocab.txt, tokenizer.model, ...); send token ids as {\"input_ids\": [...]} instead")
    with tokenizer_dir(files) as d:
        try:
            return transformers.AutoTokenizer.from_pretrained(str(d), trust_remote_code=False, local_files_only=True)
        except Exception as e:  # a broken or foreign tokenizer: the user's to fix
            raise _bad(f"the model directory's tokenizer cannot be loaded: {type(e).__name__}: "
                       f"{str(e)[:300]}") from None


def token_sequences(lines: Sequence[CalibrationLine], tokenizer: Any, *, samples: int, max_seq_len: int
                    ) -> list[torch.Tensor]:
    """The first ``samples`` lines as 1-D int64 token tensors, each at most ``max_seq_len`` long (texts
    tokenised with the model's special tokens)."""
    out = []
    for cl in lines[:samples]:
        if cl.input_ids is not None:
            ids = list(cl.input_ids)
        else:
            ids = list(tokenizer(cl.text, truncation=True, max_length=max_seq_len)["input_ids"])
        if not ids:
            raise _bad(f"calibration line {cl.line}: the tokenizer gives no tokens")
        out.append(torch.tensor(ids[:max_seq_len], dtype=torch.int64))
    return out


def pad_batch(seqs: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` ``[B, T]`` padded on the right with ``pad_id`` and the ``attention_mask`` (1 = token)."""
    width = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):  # one copy a sequence (a batch holds a handful)
        ids[i, :s.numel()] = s
        mask[i, :s.numel()] = 1
    return ids, mask
