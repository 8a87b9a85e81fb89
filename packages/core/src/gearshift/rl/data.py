"""Prompt datasets: jsonl or parquet rows with a prompt column, drawn in seeded shuffled batches.

A row's prompt is a string, or chat messages [{"role", "content"}] rendered
with the tokenizer's chat template (with the generation prompt). Every other
column is kept and reaches the reward function as a keyword.

    data = PromptDataset.from_file("train.jsonl", seed=0)
    data.bind(tokenizer, max_prompt_len=512)
    rows = data.next_batch(32)        # each row also carries "prompt_ids"
    state = data.state_dict()         # {"epoch", "index", ...}: a resumed run gets the exact next batch
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

TRUNCATION = ("error", "left", "right")  # left: drop the start of a long prompt, keep its end


class DataError(ValueError):
    """Bad data or a bad data setting; the message names the file and line (or row) at fault."""


class Row(dict):
    """One dataset row (column -> value); `origin` ("train.jsonl:17") names it in error messages."""

    __slots__ = ("origin",)

    def __init__(self, data: Mapping[str, Any] = (), origin: str = "") -> None:
        super().__init__(data)
        self.origin = origin


def check_prompt(row: Mapping[str, Any], prompt_key: str, origin: str) -> None:
    """Raise a `DataError` naming `origin` when the row has no usable prompt."""
    if prompt_key not in row:
        raise DataError(f"{origin}: no {prompt_key!r} column (columns: {', '.join(map(str, row)) or 'none'}); "
                        f"rename the column to {prompt_key!r} or set data.prompt_key")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{origin}: the prompt is empty")
        return
    if isinstance(prompt, (list, tuple)) and prompt:
        for i, message in enumerate(prompt):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{origin}: chat message {i} of the prompt is {message!r}; each message must be "
                                f"{{'role': str, 'content': str}}")
        return
    raise DataError(f"{origin}: {prompt_key!r} must be a string or a non-empty list of chat messages "
                    f"{{'role', 'content'}}, got {type(prompt).__name__} {_short(prompt)}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def read_rows(path: str | Path, *, prompt_key: str = "prompt") -> list[Row]:
    """Every row of a .jsonl (.ndjson) or .parquet file, each checked for a usable prompt."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = _read_jsonl(path)
    elif suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        raise DataError(f"{path}: unknown data format {suffix or '(no extension)'!r}; use .jsonl or .parquet")
    if not rows:
        raise DataError(f"{path} has no rows")
    for row in rows:
        check_prompt(row, prompt_key, row.origin)
    return rows


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise DataError(f"{where}: not UTF-8 text ({err.reason})") from None
            if not line:
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(value, dict):
                raise DataError(f"{where}: each line must be a JSON object (a row), got {type(value).__name__}")
            rows.append(Row(value, where))
    return rows


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from err
    return [Row(row, f"{path}: row {i}") for i, row in enumerate(table.to_pylist(), start=1)]


def as_prompt_dataset(source: Any, *, prompt_key: str = "prompt", seed: int = 0,
                      shuffle: bool = True) -> "PromptDataset":
    """A `PromptDataset` from what users hand over: one already, a jsonl/parquet path, a Hugging Face
    `datasets.Dataset`, or any sequence of row mappings (a list of dicts, a pandas frame's records)."""
    if isinstance(source, PromptDataset):
        return source
    if isinstance(source, (str, Path)):
        return PromptDataset.from_file(source, prompt_key=prompt_key, seed=seed, shuffle=shuffle)
    if hasattr(source, "column_names") and hasattr(source, "to_list"):  # datasets.Dataset
        rows = source.to_list()
    elif isinstance(source, Sequence) and not isinstance(source, (bytes, Mapping)):
        rows = list(source)
    else:
        raise DataError(f"a dataset is a jsonl/parquet path, a datasets.Dataset or a list of row mappings "
                        f"(each with a {prompt_key!r} column), got {type(source).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"row {i}: each row must be a mapping of column -> value, got {type(row).__name__}")
    return PromptDataset(rows, prompt_key=prompt_key, seed=seed, shuffle=shuffle)


def render_prompt(prompt: str | Sequence[Mapping[str, str]], tokenizer, origin: str = "prompt",
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt as text: a string as is, chat messages through the tokenizer's chat template (with the
    `tools` schemas, when given)."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{origin}: the prompt is a list of chat messages but the tokenizer has no chat "
                        f"template; give the prompt as a string, or use a tokenizer with a chat template")
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template([dict(m) for m in prompt], tokenize=False, add_generation_prompt=True,
                                         **extra)


def tokenize_prompts(rows: Sequence[Mapping[str, Any]], tokenizer, *, prompt_key: str = "prompt",
                     max_prompt_len: int | None = None, truncation: str = "error",
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[list[int]]:
    """Prompt token ids of each row; a prompt over `max_prompt_len` tokens raises, or is cut (`truncation`)."""
    if truncation not in TRUNCATION:
        raise DataError(f"truncation={truncation!r}: use one of {', '.join(TRUNCATION)}")
    origins = [getattr(row, "origin", "") or f"row {i}" for i, row in enumerate(rows)]
    texts = [render_prompt(row[prompt_key], tokenizer, origin, tools) for row, origin in zip(rows, origins)]
    is_chat = [not isinstance(row[prompt_key], str) for row in rows]
    ids: list[list[int]] = [[] for _ in rows]
    # a rendered chat template already holds its special tokens (BOS); a plain string gets the tokenizer's
    for chat in (False, True):
        picked = [i for i, c in enumerate(is_chat) if c == chat]
        if picked:
            encoded = tokenizer([texts[i] for i in picked], add_special_tokens=not chat)["input_ids"]
            for i, tokens in zip(picked, encoded):
                ids[i] = list(tokens)
    for i, tokens in enumerate(ids):
        if not tokens:
            raise DataError(f"{origins[i]}: the prompt has no tokens")
        if max_prompt_len is not None and len(tokens) > max_prompt_len:
            if truncation == "error":
                raise DataError(
                    f"{origins[i]}: the prompt has {len(tokens)} tokens, more than max_prompt_len={max_prompt_len}; "
                    f"shorten it, raise data.max_prompt_len, or truncate ('left' keeps the end)"
                )
            ids[i] = tokens[-max_prompt_len:] if truncation == "left" else tokens[:max_prompt_len]
    return ids


class PromptDataset:
    """Rows with a prompt, served in batches from a per-epoch seeded shuffle, from a resumable position."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, prompt_key: str = "prompt", seed: int = 0,
                 shuffle: bool = True) -> None:
        self.rows = [r if isinstance(r, Row) else Row(r, f"row {i}") for i, r in enumerate(rows)]
        if not self.rows:
            raise DataError("the dataset has no rows")
        for row in self.rows:
            check_prompt(row, prompt_key, row.origin)
        self.prompt_key = prompt_key
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # rows of this epoch's order already served
        self._order_cache: tuple[int, list[int]] | None = None
        self._prompt_ids: list[list[int]] | None = None

    @classmethod
    def from_file(cls, path: str | Path, *, prompt_key: str = "prompt", seed: int = 0,
                  shuffle: bool = True) -> "PromptDataset":
        return cls(read_rows(path, prompt_key=prompt_key), prompt_key=prompt_key, seed=seed, shuffle=shuffle)

    @classmethod
    def from_task(cls, name: str, n: int = 4096, *, seed: int = 0, **options) -> "PromptDataset":
        """A built-in synthetic task (`gearshift.rl.tasks`)."""
        from .tasks import make_task

        return cls(make_task(name, n, seed=seed, **options), seed=seed)

    @classmethod
    def from_config(cls, cfg) -> "PromptDataset":
        """From a data config: `path` (jsonl/parquet) or, when it is empty, the built-in `task`."""
        seed = getattr(cfg, "seed", 0)
        if getattr(cfg, "path", None):
            return cls.from_file(cfg.path, prompt_key=getattr(cfg, "prompt_key", "prompt"), seed=seed)
        from .tasks import options_for

        task = getattr(cfg, "task", "add")
        return cls.from_task(task, seed=seed, **options_for(task, getattr(cfg, "task_options", None) or {}))

    def __len__(self) -> int:
        return len(self.rows)

    def all_rows(self) -> list[Row]:
        """Every row in file order (copies, with "prompt_ids" once bound): a held-out set is read whole."""
        return [self._serve(i) for i in range(len(self.rows))]

    @property
    def columns(self) -> list[str]:
        """Columns present in every row (what a reward can rely on)."""
        common = set(self.rows[0])
        for row in self.rows[1:]:
            common &= row.keys()
        return sorted(common)

    def bind(self, tokenizer, *, max_prompt_len: int | None = None, truncation: str = "error",
             tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Tokenize every prompt now, so a prompt that is too long fails at start-up, not mid-run (`tools`:
        schemas a chat prompt is rendered with)."""
        self._prompt_ids = tokenize_prompts(self.rows, tokenizer, prompt_key=self.prompt_key,
                                            max_prompt_len=max_prompt_len, truncation=truncation, tools=tools)

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(len(self.rows), generator=gen).tolist()
            else:
                order = list(range(len(self.rows)))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self, size: int) -> list[Row]:
        """The next `size` rows (copies), continuing into the next epoch's order when this one runs out.

        Rows carry "prompt_ids" once the dataset is bound to a tokenizer.
        """
        if not 1 <= size <= len(self.rows):
            raise DataError(f"batch of {size} prompts from a dataset of {len(self.rows)} rows; "
                            f"use a batch size between 1 and {len(self.rows)} or add rows")
        picked: list[int] = []
        while len(picked) < size:
            take = min(size - len(picked), len(self.rows) - self.index)
            picked += self._order(self.epoch)[self.index:self.index + take]
            self.index += take
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
        return [self._serve(i) for i in picked]

    def _serve(self, i: int) -> Row:
        row = Row(self.rows[i], self.rows[i].origin)
        if self._prompt_ids is not None:
            row["prompt_ids"] = list(self._prompt_ids[i])
        return row

    def batches(self, size: int) -> Iterator[list[Row]]:
        """`next_batch(size)` forever (epoch after epoch)."""
        while True:
            yield self.next_batch(size)

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "size": len(self.rows)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position; the saved seed and shuffle win, so the order is the one saved."""
        if state.get("size", len(self.rows)) != len(self.rows):
            raise DataError(f"the saved data position is for a dataset of {state['size']} rows, this one has "
                            f"{len(self.rows)}; resume with the same data, or start a new run")
        if not 0 <= state["index"] < len(self.rows) or state["epoch"] < 0:
            raise DataError(f"bad saved data position epoch={state['epoch']}, index={state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._order_cache = None
