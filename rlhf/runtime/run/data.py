"""Prompt datasets: load with `datasets`, mix, format, tokenise, and hand out batches in a
resumable order.

Files (.jsonl, .json, .parquet, .csv), ``save_to_disk`` folders and hub names load the same
way. Rows keep their origin (file and 1-based row) so a bad row is named precisely.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.core.inputs.text_bounds import keep_end

log = logging.getLogger(__name__)

_SOURCE, _ROW = "__rlhf_source__", "__rlhf_row__"
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ConfigError):
    """A dataset that cannot be used as given."""


@dataclass(kw_only=True)
class PromptItem:
    """One formatted prompt, ready for the rollout engine."""

    prompt: Any  # as in the dataset: a string or chat messages
    prompt_text: str  # after chat/input templates
    prompt_ids: list[int]
    label: Any
    columns: dict[str, Any]  # every column except the prompt column (label included by its name)
    origin: str  # "file.jsonl row 12", for messages
    truncated: bool = False


@dataclass(kw_only=True)
class DataSettings:
    paths: list[str]
    input_key: str = "prompt"
    label_key: str | None = None
    allow_missing_labels: bool = False
    probs: list[float] | None = None
    split: str = "train"
    apply_chat_template: bool = False
    input_template: str | None = None
    max_prompt_length: int = 1024
    max_samples: int | None = None
    seed: int = 42


def load_one(path: str, split: str):
    """A `datasets.Dataset` from a file, a save_to_disk folder or a hub name."""
    import datasets

    local = Path(path)
    try:
        if local.is_file():
            builder = _FILE_BUILDERS.get(local.suffix)
            if builder is None:
                raise DataError(f"{path}: unsupported file type {local.suffix!r}; use .jsonl, .json, .parquet or .csv")
            if local.suffix != ".parquet":
                check_utf8(local)
                if _blank(local):
                    raise DataError(f"{path}: the file is empty")
            if local.suffix in (".jsonl", ".json"):
                check_json_shape(local)  # before pyarrow's reader, which a row nested deep enough crashes
            try:
                with _quiet_logger(f"datasets.packaged_modules.{builder}.{builder}"):  # its own log line of the error
                    return datasets.load_dataset(builder, data_files=str(local), split="train")
            except Exception:
                if local.suffix == ".jsonl":
                    check_json_lines(local)  # names the line that broke it
                raise
        if local.is_dir():
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{path}: no split {split!r}; splits: {', '.join(loaded)}")
                return loaded[split]
            return loaded
        if local.suffix in _FILE_BUILDERS:
            raise DataError(f"data file {path!r} does not exist")
        return datasets.load_dataset(path, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the path and the cause
        raise DataError(f"could not load dataset {path!r}: {type(exc).__name__}: {exc}") from exc


def _blank(path: Path, chunk: int = 1 << 16) -> bool:
    """Whether the file holds nothing but whitespace (read until its first other byte)."""
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            if block.strip():
                return False
    return True


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """The logger ``name`` silent inside the block (datasets logs a parse error before raising it,
    with a row number of its own; the error we raise names the file and line)."""
    logger = logging.getLogger(name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """Text data must be UTF-8: name the line and byte of the first that is not."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while True:
            data = handle.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                position = offset + exc.start - len(decoder.getstate()[0])
                with open(path, "rb") as again:
                    before = again.read(max(position, 0))
                line = before.count(b"\n") + 1
                column = len(before) - (before.rfind(b"\n") + 1) + 1
                raise DataError(f"{path} line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at column "
                                f"{column}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not data:
                return
            offset += len(data)


def check_json_lines(path: Path) -> None:
    """Raise a `DataError` naming the first line of a .jsonl file that is not a JSON object."""
    import json

    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno}): "
                                f"{_shorten(line.strip())}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {number}: each line must be a JSON object {{...}}, got "
                                f"{type(row).__name__}: {_shorten(line.strip())}")


MAX_DEPTH = 1000  # levels of [ and { one JSON value may nest (pyarrow's JSON reader crashes at ~20,000)
MAX_ROW_BYTES = 512 << 20  # bytes of one .jsonl line (one row)
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (skipped whole) and brackets


def check_json_shape(path: Path) -> None:
    """Refuse a .jsonl line (row) longer than `MAX_ROW_BYTES`, or a JSON value nested more than
    `MAX_DEPTH` deep anywhere in a .jsonl or .json file, with a `DataError` naming the file and line,
    before the file reaches `datasets` (pyarrow's JSON reader dies of a segmentation fault on a row
    nested 20,000 deep, in a column the run does not even use). Read once, a line at a time (of a
    .json file the depth is carried from line to line); a .jsonl line holding fewer brackets than
    `MAX_DEPTH` cannot nest deeper and is not scanned further."""
    whole = path.suffix == ".json"
    depth = 0
    with open(path, "rb") as handle:
        number = 0
        while line := handle.readline(MAX_ROW_BYTES + 1):
            number += 1
            if whole:
                if b"[" not in line and b"{" not in line and b"]" not in line and b"}" not in line:
                    continue
            else:
                if len(line) > MAX_ROW_BYTES:
                    raise DataError(f"{path} line {number}: a row of more than {MAX_ROW_BYTES >> 20} MiB; split it "
                                    "or drop it")
                depth = 0
                if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
                    continue
            for token in _JSON_TOKENS.finditer(line):
                mark = token.group()
                if mark in (b"[", b"{"):
                    depth += 1
                    if depth > MAX_DEPTH:
                        raise DataError(f"{path} line {number}: a value nested more than {MAX_DEPTH:,} levels deep "
                                        "(of [ and {); such a row cannot be read safely: flatten it or drop it")
                elif mark in (b"]", b"}"):
                    depth -= 1


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def load_prompts(settings: DataSettings):
    """Load, check and mix the prompt datasets; each row remembers its file and row number."""
    rows = load_rows(settings.paths, split=settings.split, columns=[settings.input_key, settings.label_key],
                     probs=settings.probs, max_samples=settings.max_samples, seed=settings.seed,
                     hint="set --input-key / --label-key")
    if settings.label_key:
        check_labels(rows, settings.label_key, allow_missing=settings.allow_missing_labels)
    return rows


def check_labels(rows: Any, key: str, *, allow_missing: bool) -> None:
    """Rows without a label would reach the rewards with label None: refuse them, or say how many."""
    missing = [i for i, label in enumerate(rows[key]) if label is None]
    if not missing:
        return
    first = row_origin(rows[missing[0]])
    if not allow_missing:
        raise DataError(f"--label-key {key}: {len(missing)} of {len(rows)} rows have no label (the first: {first}); "
                        "fix the data, or pass --allow-missing-labels to train on them with label None")
    log.warning("--label-key %s: %d of %d rows have no label (the first: %s); their rewards get label None",
                key, len(missing), len(rows), first)


def load_rows(paths: list[str], *, split: str, columns: list[str | None], probs: list[float] | None = None,
              max_samples: int | None = None, seed: int = 42, hint: str = ""):
    """Load, check and mix datasets: every one must have ``columns`` (None entries are ignored);
    each row remembers its file and 1-based row number (`row_origin`)."""
    import datasets

    if probs is not None and len(probs) != len(paths):
        raise DataError(f"--data-probs has {len(probs)} values for {len(paths)} datasets")
    parts = []
    for path in paths:
        ds = load_one(path, split)
        for key in filter(None, columns):
            if key not in ds.column_names:
                raise DataError(f"{path}: no column {key!r} (columns: {', '.join(ds.column_names)})"
                                + (f"; {hint}" if hint else ""))
        if max_samples is not None:
            ds = ds.select(range(min(max_samples, len(ds))))
        if len(ds) == 0:
            raise DataError(f"{path}: the dataset is empty")
        ds = ds.add_column(_SOURCE, [path] * len(ds)).add_column(_ROW, list(range(1, len(ds) + 1)))
        parts.append(ds)
    if len(parts) == 1:
        return parts[0]
    if probs is None:
        return datasets.concatenate_datasets(parts)
    return datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")


def row_origin(row: dict[str, Any]) -> str:
    """``"data.jsonl row 12"`` for a row from `load_rows`."""
    return f"{row[_SOURCE]} row {row[_ROW]}"


def row_values(row: dict[str, Any]) -> dict[str, Any]:
    """A row from `load_rows` without the columns that remember its origin."""
    return {k: v for k, v in row.items() if k not in (_SOURCE, _ROW)}


class PromptFormatter:
    """Row -> `PromptItem`: templates, tokenisation, left truncation to the prompt budget."""

    def __init__(self, tokenizer: Any, settings: DataSettings):
        self.tokenizer, self.settings = tokenizer, settings
        if settings.input_template is not None and "{}" not in settings.input_template:
            raise DataError(f"--input-template must contain {{}} where the prompt goes: {settings.input_template!r}")
        if settings.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError("--apply-chat-template: the tokenizer has no chat template")
        self.truncated_count = 0

    def __call__(self, row: dict[str, Any]) -> PromptItem:
        s = self.settings
        origin = row_origin(row)
        prompt = row.get(s.input_key)
        if prompt is None or prompt == "" or prompt == []:
            raise DataError(f"{origin}: empty or missing {s.input_key!r}")
        cut = False  # the text was cut before tokenising (`rlhf.core.inputs.text_bounds`): never tokenised whole
        if s.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
                raise DataError(f"{origin}: {s.input_key!r} must be a string or a list of {{role, content}} messages")
            messages, cut = self._cut_messages(messages)
            if cut:  # what the model sees, not the megabytes before it
                prompt = messages[0]["content"] if isinstance(prompt, str) else messages
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            text, cut_again = keep_end(text, self.tokenizer, s.max_prompt_length)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            cut = cut or cut_again
        else:
            if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
                raise DataError(f"{origin}: {s.input_key!r} holds chat messages; add --apply-chat-template")
            if not isinstance(prompt, str):
                raise DataError(f"{origin}: {s.input_key!r} must be a string (or a list of {{role, content}} "
                                f"messages, with --apply-chat-template); got {type(prompt).__name__} "
                                f"{_shorten(repr(prompt), 60)}")
            prompt, cut = keep_end(prompt, self.tokenizer, s.max_prompt_length)
            text = s.input_template.replace("{}", prompt) if s.input_template else prompt
            text, cut_again = keep_end(text, self.tokenizer, s.max_prompt_length)  # a template of megabytes
            ids = self.tokenizer(text)["input_ids"]
            cut = cut or cut_again
        truncated = cut or len(ids) > s.max_prompt_length
        if truncated:
            ids = ids[-s.max_prompt_length:]
            self.truncated_count += 1
            if self.truncated_count == 1:
                log.warning("%s: prompt longer than --max-prompt-length %d tokens; its start was cut (said for the "
                            "first such prompt only; raise --max-prompt-length to keep prompts whole)", origin,
                            s.max_prompt_length)
        columns = {k: v for k, v in row.items() if k not in (s.input_key, _SOURCE, _ROW)}
        label = row[s.label_key] if s.label_key else None
        return PromptItem(prompt=prompt, prompt_text=text, prompt_ids=list(ids), label=label, columns=columns,
                          origin=origin, truncated=truncated)

    def _cut_messages(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
        """Each message's text cut to its end beyond what the prompt budget could keep (`keep_end`)."""
        out, cut = [], False
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                content, was_cut = keep_end(content, self.tokenizer, self.settings.max_prompt_length)
                if was_cut:
                    message, cut = {**message, "content": content}, True
            out.append(message)
        return out, cut


@dataclass
class PromptLoader:
    """Hands out batches of prompts forever: a fresh shuffle per epoch (seeded), and a position
    that checkpoints store so a resumed run sees the same prompts."""

    dataset: Any
    formatter: PromptFormatter
    seed: int = 42
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.dataset)

    def _epoch_order(self) -> list[int]:
        import torch

        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def next_batch(self, size: int) -> list[PromptItem]:
        items = []
        while len(items) < size:
            if not self._order:
                self._order = self._epoch_order()
            if self.position >= len(self._order):
                self.epoch, self.position, self._order = self.epoch + 1, 0, []
                continue
            items.append(self.formatter(self.dataset[self._order[self.position]]))
            self.position += 1
        return items

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = state["epoch"], state["position"], []
