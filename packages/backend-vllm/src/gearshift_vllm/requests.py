"""gearshift's sampling parameters as vLLM's, and vLLM's completions as gearshift's rollouts."""

from __future__ import annotations

from typing import Sequence

from gearshift.rollout import Rollout, RolloutError, SamplingParams, text_before_stop


def vllm_sampling(vllm, s: SamplingParams, index: int, room: int, request_seed: bool = True):
    """vLLM's `SamplingParams` for prompt `index` of a request, with `room` tokens left in the context;
    `request_seed=False`: no seed of its own (the call's seed seeds the engine's generator instead)."""
    extra = {"flat_logprobs": True} if _has_flat_logprobs(vllm) else {}
    return vllm.SamplingParams(
        **extra, n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        max_tokens=min(s.max_tokens, room),
        stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None,
        # vLLM gives the k-th sample of a request seed + k: spacing by n keeps every sample's seed distinct
        seed=None if s.seed is None or not request_seed else s.seed + index * s.n,
        logprobs=0 if s.logprobs else None,  # the sampled token's logprob only, or none
        # incremental detokenizing (of every logprob's token too) costs about a third of the time
        # on small models; only stop strings need it, and `text` is decoded once at the end
        detokenize=bool(s.stop),
    )


def _has_flat_logprobs(vllm) -> bool:
    """Whether this vLLM returns logprobs as flat lists (`SamplingParams.flat_logprobs`, 0.12 on): a few lists
    per request where the default builds a dict and a `Logprob` object per generated token, 65,536 of each
    for 32 x 8 answers of 256 tokens, in the trainer's process, for its garbage collector to walk."""
    return "flat_logprobs" in getattr(vllm.SamplingParams, "__struct_fields__", ())


def sampled_logprobs(sample, tokens: list[int]) -> list[float]:
    """The logprob of each sampled token of `sample` (vLLM's `CompletionOutput`), from flat or per-token
    logprobs."""
    lp = sample.logprobs
    if lp is None:  # none asked for
        return []
    flat = getattr(lp, "start_indices", None)
    if flat is None:
        return [float(step[token].logprob) for step, token in zip(lp, tokens)]
    if len(lp.logprobs) == len(tokens):  # logprobs=0: the sampled token's alone at each position
        return [float(x) for x in lp.logprobs]
    ids, values = lp.token_ids, lp.logprobs
    return [float(next(values[j] for j in range(lp.start_indices[i], lp.end_indices[i]) if ids[j] == token))
            for i, token in enumerate(tokens)]


def to_rollout(prompt: list[int], sample, index: int, stop: Sequence[str], tokenizer) -> Rollout:
    """One of vLLM's completions (`CompletionOutput`) of prompt `index` as a `Rollout`, its text decoded."""
    tokens = list(sample.token_ids)
    logprobs = sampled_logprobs(sample, tokens)
    if sample.finish_reason not in ("stop", "length"):
        raise RolloutError(f"vLLM ended prompt {index} with finish reason {sample.finish_reason!r}")
    return Rollout(prompt, tokens, logprobs, sample.finish_reason, prompt_index=index,
                   sample_index=sample.index,
                   text=text_before_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop))
