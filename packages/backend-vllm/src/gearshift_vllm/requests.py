"""gearshift's sampling parameters as vLLM's, and vLLM's completions as gearshift's rollouts."""

from __future__ import annotations

from typing import Sequence

from gearshift.rollout import Rollout, RolloutError, SamplingParams, text_before_stop


def vllm_sampling(vllm, s: SamplingParams, index: int, room: int, request_seed: bool = True):
    """vLLM's `SamplingParams` for prompt `index` of a request, with `room` tokens left in the context;
    `request_seed=False`: no seed of its own (the call's seed seeds the engine's generator instead)."""
    return vllm.SamplingParams(
        n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        max_tokens=min(s.max_tokens, room),
        stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None,
        # vLLM gives the k-th sample of a request seed + k: spacing by n keeps every sample's seed distinct
        seed=None if s.seed is None or not request_seed else s.seed + index * s.n,
        logprobs=0,  # the sampled token's logprob only
        # incremental detokenizing (of every logprob's token too) costs about a third of the time
        # on small models; only stop strings need it, and `text` is decoded once at the end
        detokenize=bool(s.stop),
    )


def to_rollout(prompt: list[int], sample, index: int, stop: Sequence[str], tokenizer) -> Rollout:
    """One of vLLM's completions (`CompletionOutput`) of prompt `index` as a `Rollout`, its text decoded."""
    tokens = list(sample.token_ids)
    logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)]
    if sample.finish_reason not in ("stop", "length"):
        raise RolloutError(f"vLLM ended prompt {index} with finish reason {sample.finish_reason!r}")
    return Rollout(prompt, tokens, logprobs, sample.finish_reason, prompt_index=index,
                   sample_index=sample.index,
                   text=text_before_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop))
