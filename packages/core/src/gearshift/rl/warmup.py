"""Starting points for the built-in tasks: a random model taught the answer *format*, not the answers.

RL needs a policy that sometimes produces a well-formed answer. A model with
random weights almost never does, so `format_warmup` fine-tunes it briefly on
the task's prompts followed by answers drawn at random from the task's
answer set: afterwards it answers in the right form, and is right about as
often as chance. The RL job then has to learn the task itself.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from ..backends.torch_train import TorchTrainEngine
from ..models.tiny import build_model
from ..train import TrainBatch, nll_loss


def format_warmup(base: str, out: str | Path, rows: list[dict], *, steps: int = 40, batch_size: int = 64,
                  lr: float = 1e-3, seed: int = 0) -> str:
    """Fine-tune `base` on `rows` with shuffled answers and save the result to `out` (a HF folder)."""
    from transformers import AutoTokenizer

    from .data import tokenize_prompts

    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(seed)
    answers = [r["answer"] for r in rows]
    prompts = tokenize_prompts(rows, tokenizer)
    wrong = [tokenizer(rng.choice(answers), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
             for _ in rows]
    _fit(base, out, prompts, wrong, None, rng, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
         pad_id=tokenizer.pad_token_id)
    return str(out)


def near_miss(answer: str, rng: random.Random) -> str:
    """`answer` (a number) with one of its digits changed to another: never the answer, one digit off it
    ('85' -> '35' or '87'; a leading digit is not made 0)."""
    digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
    i = rng.choice(digits)
    lead = i == digits[0] and len(digits) > 1
    other = [d for d in "0123456789" if d != answer[i] and not (lead and d == "0")]
    return answer[:i] + rng.choice(other) + answer[i + 1:]


def tool_warmup(base: str, out: str | Path, rows: list[dict], *, steps: int = 300, batch_size: int = 64,
                lr: float = 1e-3, seed: int = 0, answers: str = "length") -> str:
    """Fine-tune `base` on calculator episodes of `rows` whose final answers are wrong, and save it to `out`.

    Each example is the episode the `calc` task's agent writes: `<calc>a+b</calc>` (the model's), the tool's
    `<result>c</result>` (kept out of the loss, as in RL) and a final answer that is not read from c.
    `answers="length"` (the default, `small-calc`'s): an answer drawn at random from the task's answers with as
    many digits as c, so the model calls the tool and answers in the right form and length but is right about as
    often as chance; reading the tool's answer is left to RL whole. `answers="shuffled"`: drawn from all the
    task's answers, the length too left to RL. `answers="near"`: c with one digit changed (`near_miss`), so the
    model answers with a number near the tool's and RL only has to make it copy the answer exactly (a start
    above chance).
    """
    from transformers import AutoTokenizer

    from .agent.builtin import calc
    from .data import tokenize_prompts

    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(seed)
    if answers not in ("shuffled", "length", "near"):
        raise ValueError(f"answers={answers!r}: use 'shuffled', 'length' or 'near'")
    pool = [r["answer"] for r in rows]
    by_length: dict[int, list[str]] = {}  # the pool by number of digits: a row's answer's length is always there
    for a in pool:
        by_length.setdefault(len(a), []).append(a)
    prompts = tokenize_prompts(rows, tokenizer)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    episodes, masks = [], []
    for row in rows:
        expression = row["prompt"].rstrip("=")
        value = calc(expression)
        call, result = encode(f"<calc>{expression}</calc>"), encode(f"<result>{value}</result>")
        if answers == "near":
            final = near_miss(value, rng)
        elif answers == "length":
            final = rng.choice(by_length[len(value)])
        else:
            final = rng.choice(pool)
        answer = encode(final) + [tokenizer.eos_token_id]
        episodes.append(call + result + answer)
        masks.append([1] * len(call) + [0] * len(result) + [1] * len(answer))
    _fit(base, out, prompts, episodes, masks, rng, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
         pad_id=tokenizer.pad_token_id)
    return str(out)


def _fit(base: str, out: str | Path, prompts: list[list[int]], completions: list[list[int]],
         masks: list[list[int]] | None, rng: random.Random, *, steps: int, batch_size: int, lr: float, seed: int,
         pad_id: int) -> None:
    """`steps` of next-token loss on random batches of (prompt, completion) from `base`, saved to `out`;
    `masks` (1: in the loss) picks the completion tokens that count, when given."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    # a batch of distinct prompts shares none; off, each recipe builds the model it built before shared prompts
    engine = TorchTrainEngine.build(base, lr=lr, seed=seed, share_prompts=False)
    # built once per cache, but minutes long on a CPU: say what it is doing (on stderr, off when not a terminal)
    for _ in tqdm(range(steps), desc=f"warming up {Path(out).name}", unit="step", leave=False,
                  disable=None, mininterval=2.0):
        pick = rng.sample(range(len(prompts)), min(batch_size, len(prompts)))
        batch = TrainBatch.from_sequences([prompts[i] for i in pick], [completions[i] for i in pick], pad_id=pad_id)
        for j, i in enumerate(pick if masks is not None else ()):
            start = len(prompts[i])
            batch.loss_mask[j, start:start + len(masks[i])] *= torch.tensor(masks[i], dtype=batch.loss_mask.dtype)
        engine.train_step(batch, nll_loss)
    engine.save_hf(str(out))


#: the task options the '<preset>-<task>' models are warmed up with; the default job's data uses the same
TASK_MODEL_OPTIONS = {"add": {"digits": 1, "second": 1}}
#: tasks whose models are warmed up on tool-calling episodes (`tool_warmup`) rather than bare answers
TOOL_WARMUPS = {"calc": tool_warmup}


def build_task_model(path: str | Path, preset: str, task: str, *, seed: int = 0, **task_options) -> str:
    """The preset's random model after `format_warmup` on `task`, built once under `path`."""
    from .tasks import make_task

    path = Path(path)
    done = path / "gearshift-warmup.done"
    # tool-v4: answers of the tool's length, the model at chance (tool-v3: shuffled answers; tool-v2: near-miss
    # answers; tool-v1: shuffled, before the exact-match reward); a model built by an older recipe is built again
    version = "tool-v4" if task in TOOL_WARMUPS else "v2"
    recipe = f"{preset} {task} {sorted(task_options.items())} seed={seed} warmup={version}\n"
    if done.exists() and done.read_text() == recipe:
        return str(path)
    print(f"gearshift: building {preset}-{task} once (a random {preset} model, warmed up on {task}) in {path}",
          file=sys.stderr, flush=True)
    base = build_model(path / "base", preset=preset, seed=seed)
    rows = make_task(task, 2000, seed=seed + 1, **task_options)
    TOOL_WARMUPS.get(task, format_warmup)(base, path, rows, seed=seed)
    done.write_text(recipe)
    return str(path)
