"""Built-in synthetic tasks: seeded rows {prompt, answer} a tiny model can learn on a CPU.

Prompts are a few characters (the tiny models' tokenizer spends one token per
byte), and answers are checked by `gearshift.rl.rewards:exact_match` or
`numeric_match`.

    rows = make_task("add", 1000, seed=0, digits=2)   # {"prompt": "12+7=", "answer": "19"}
    write_jsonl(rows, "add.jsonl")
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Callable, Iterable

_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                              "*": lambda a, b: a * b}


def arithmetic(n: int, *, seed: int = 0, digits: int = 2, ops: str = "+", max_operand: int | None = None,
               second: int | None = None) -> list[dict]:
    """`n` problems "a<op>b=" with operands of up to `digits` digits (or up to `max_operand`), or with
    the second operand fixed to `second`; subtraction never goes negative."""
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    if max_operand is not None and max_operand < 1:
        raise ValueError(f"max_operand={max_operand} must be >= 1")
    unknown = set(ops) - set(_OPS)
    if not ops or unknown:
        raise ValueError(f"ops={ops!r}: use any of {''.join(_OPS)!r}")
    rng = random.Random(seed)
    top = 10**digits - 1 if max_operand is None else max_operand
    rows = []
    for _ in range(n):
        op = rng.choice(ops)
        a, b = rng.randint(0, top), rng.randint(0, top) if second is None else second
        if op == "-" and a < b:
            a, b = b, a
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))})
    return rows


def addition(n: int, *, seed: int = 0, digits: int = 2, max_operand: int | None = None,
             second: int | None = None) -> list[dict]:
    """"a+b=" with operands of up to `digits` digits (or up to `max_operand`, or b fixed to `second`)."""
    return arithmetic(n, seed=seed, digits=digits, ops="+", max_operand=max_operand, second=second)


def reverse(n: int, *, seed: int = 0, min_len: int = 3, max_len: int = 5) -> list[dict]:
    """`n` prompts "rev abc=" answered by the letters reversed ("cba")."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
        rows.append({"prompt": f"rev {word}=", "answer": word[::-1]})
    return rows


def calc(n: int, *, seed: int = 0, digits: int = 2) -> list[dict]:
    """"a+b=" with operands of `digits` digits, for a model with a calculator tool (`TASK_AGENTS`): it can
    call `<calc>a+b</calc>`, read `<result>c</result>`, and answer c."""
    return arithmetic(n, seed=seed, digits=digits, ops="+")


def guess(n: int, *, seed: int = 0, top: int = 9) -> list[dict]:
    """"guess 0-9:" with a hidden integer `answer` in [0, top], found over turns of higher/lower answers
    (the `GuessNumber` environment, which owns the reward)."""
    if top < 1:
        raise ValueError(f"top={top} must be >= 1")
    rng = random.Random(seed)
    return [{"prompt": f"guess 0-{top}:", "answer": str(rng.randint(0, top))} for _ in range(n)]


TASKS: dict[str, Callable[..., list[dict]]] = {"add": addition, "arith": arithmetic, "reverse": reverse,
                                               "calc": calc, "guess": guess}

#: the reward that grades each task
TASK_REWARDS = {"add": "gearshift.rl.rewards:numeric_match", "arith": "gearshift.rl.rewards:numeric_match",
                "reverse": "gearshift.rl.rewards:exact_match", "calc": "gearshift.rl.rewards:exact_match",
                "guess": "gearshift.rl.rewards:numeric_match"}

#: the tools and environment a task's episodes have (`agent.*` adds to them)
TASK_AGENTS = {"calc": {"tools": ["gearshift.rl.agent.builtin:calc"]},
               "guess": {"environment": "gearshift.rl.agent.builtin:GuessNumber"}}


#: `data.task_options`' default: the default job's (add with a second operand of 1)
DEFAULT_JOB_OPTIONS = {"digits": 1, "second": 1}


def options_for(name: str, options: dict) -> dict:
    """The options a task is made with: the default job's left untouched are add's (and arith's) only, so
    another task named alone (`data.task=calc`) gets its own defaults."""
    if options == DEFAULT_JOB_OPTIONS and name not in ("add", "arith"):
        return {}
    return dict(options)


def make_task(name: str, n: int = 4096, *, seed: int = 0, **options) -> list[dict]:
    """`n` rows of the built-in task `name` (add, arith, reverse, calc, guess); `options` set its difficulty."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    if n < 1:
        raise ValueError(f"a task needs at least 1 row, got n={n}")
    return TASKS[name](n, seed=seed, **options)


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows one JSON object per line (the format `PromptDataset.from_file` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
