"""Many switches in a row: no growth of process memory, and the rollout engine still serves the
training engine's exact weights after the last one. 200 switches with --runslow, 20 otherwise."""

import os

import pytest

from gearshift import HybridActor, SamplingParams, registry

PAIRS = [("torch", "hf"), ("fsdp", "hf"), ("torch", "vllm"), ("fsdp", "vllm")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [[72, 101, 108], [49, 43, 50, 61]]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")



@pytest.mark.parametrize("train,rollout", PAIRS, ids=[f"{t}-{r}" for t, r in PAIRS])
def test_switches_do_not_leak_or_drift(train, rollout, gearshift_model, request):
    if not (registry.ready("train", train) and registry.ready("rollout", rollout)):
        if os.environ.get("CI"):
            pytest.fail(f"{train}/{rollout} not installed: tools/install.sh installs every in-tree backend")
        pytest.skip(f"{train}/{rollout} not installed")
    count = 200 if request.config.getoption("--runslow") else 20
    t = registry.create("train", train, model=gearshift_model)
    r = registry.create("rollout", rollout, model=gearshift_model)
    try:
        actor = HybridActor(t, r)
        actor.to_rollout()
        first = actor.generate(PROMPTS, GREEDY)
        actor.to_train()
        for _ in range(5):  # allocator pools and caches settle first
            actor.to_rollout()
            actor.to_train()
        before = rss_bytes()
        for _ in range(count):
            actor.to_rollout()
            actor.to_train()
        grown = rss_bytes() - before
        actor.to_rollout()
        last = actor.generate(PROMPTS, GREEDY)
        actor.to_train()
        print(f"{train}/{rollout}: {count} switches, resident memory grew by {grown / 2**20:.1f} MiB")
        assert grown < 64 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over {count} switches"
        assert [x.token_ids for x in last] == [x.token_ids for x in first]
        assert [x.logprobs for x in last] == [x.logprobs for x in first]  # bit-exact: the same weights
    finally:
        r.close()
        t.close()
