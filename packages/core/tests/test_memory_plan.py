"""The switch's memory plan on a simulated GPU: what the rollout engine can map is memory the driver has free,
not blocks torch's caching allocator keeps; the trainer's weights leave only after the sync has read them;
host buffers for what a switch may move are allocated at start; the default micro-batches fit free memory."""

from types import SimpleNamespace

import pytest
import torch

from gearshift import HybridActor
from gearshift.memory import GiB, MemoryPlanError, activation_bytes_per_token
from gearshift.rollout import RolloutEngine
from gearshift.train import TrainEngine
from gearshift.weights import ParamSpec, WeightSpec


class Device:
    """A GPU's memory as torch and the driver see it: torch's allocations, the blocks torch caches, and what
    an engine with an allocator of its own (vLLM's sleep mode) maps straight from the driver."""

    def __init__(self, total: int) -> None:
        self.total, self.allocated, self.cached, self.mapped, self.peak, self.events = total, 0, 0, 0, 0, []

    def free(self) -> int:
        return self.total - self.allocated - self.cached - self.mapped

    def alloc(self, n: int) -> None:  # torch reuses its cache first
        reuse = min(n, self.cached)
        self.cached -= reuse
        if n - reuse > self.free():
            raise torch.OutOfMemoryError("CUDA out of memory (torch)")
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def release(self, n: int) -> None:  # freed tensors go to torch's cache, not to the driver
        self.allocated -= n
        self.cached += n

    def patch(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free(), self.total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.allocated + self.cached)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)

        def empty_cache():
            self.events.append("empty_cache")
            self.cached = 0

        monkeypatch.setattr(cuda, "empty_cache", empty_cache)


class Trainer(TrainEngine):
    """State of known sizes on the simulated device; a step allocates activations and frees them."""

    def __init__(self, dev: Device, sizes: dict[str, int], activations: int) -> None:
        self.dev, self.sizes, self.activations = dev, dict(sizes), activations
        self.device, self.away, self.reserved = torch.device("cuda"), set(), []
        self.args = SimpleNamespace(torch_dtype=torch.float32)
        self.mesh = None
        dev.alloc(sum(sizes.values()))
        self._spec = WeightSpec.from_tensors({"w": torch.zeros(2)})

    def weight_spec(self):
        return self._spec

    def local_weights(self, names):
        assert "params" not in self.away, "the sync read weights that were moved to host memory"
        self.dev.events.append("export")
        return {"w": torch.zeros(2)}

    def state_bytes(self):
        return {t: 0 if t in self.away else n for t, n in self.sizes.items()}

    def reserve_host(self, tags):
        self.reserved.append(tuple(tags))
        return sum(self.sizes[t] for t in tags)

    def offload(self, tags=("params", "grads", "optimizer")):
        moved = 0
        for t in tags:
            if t not in self.away:
                self.away.add(t)
                self.dev.release(self.sizes[t])
                moved += self.sizes[t]
                self.dev.events.append(f"offload {t}")
        return moved

    def onload(self, tags=("params", "grads", "optimizer")):
        back = [t for t in tags if t in self.away]
        for t in back:
            self.dev.alloc(self.sizes[t])
            self.away.discard(t)
        return sum(self.sizes[t] for t in back)

    def step(self):
        self.dev.alloc(self.activations)
        self.dev.release(self.activations)

    forward_logprobs = train_step = save = load = save_hf = lambda *a, **k: None


class Rollout(RolloutEngine):
    """Maps weights and KV cache from the driver's free memory on wake, as vLLM's sleep mode does."""

    def __init__(self, dev: Device, weights: int, kv: int) -> None:
        self.dev, self.need, self.awake = dev, {"weights": weights, "kv_cache": kv}, {"weights", "kv_cache"}
        self.device, self.max_model_len = torch.device("cuda"), 16
        self._spec = WeightSpec.from_tensors({"w": torch.zeros(2)})
        dev.mapped = weights + kv

    def weight_spec(self):
        return self._spec

    def resident_bytes(self):
        return {t: n if t in self.awake else 0 for t, n in self.need.items()}

    def sleep(self, tags=("weights", "kv_cache")):
        for t in set(tags) & self.awake:
            self.awake.discard(t)
            self.dev.mapped -= self.need[t]

    def wake(self, tags=("weights", "kv_cache")):
        for t in set(tags) - self.awake:
            if self.need[t] > self.dev.free():
                raise RuntimeError(f"CUDA Error: out of memory at cumem_allocator.cpp (waking {t})")
            self.dev.mapped += self.need[t]
            self.awake.add(t)
            self.dev.events.append(f"wake {t}")

    def update_weights(self, buckets):
        return sum(b.nbytes for b in buckets)

    generate = reset_cache = lambda *a, **k: None


def _cycle(actor, trainer, steps=3):
    for _ in range(steps):
        actor.to_rollout()
        actor.to_train()
        trainer.step()


def test_torch_cache_goes_back_before_the_rollout_engine_maps_memory(monkeypatch):
    dev = Device(100 * GiB)
    dev.patch(monkeypatch)
    trainer = Trainer(dev, {"params": 20 * GiB, "grads": 0, "optimizer": 40 * GiB}, activations=35 * GiB)
    actor = HybridActor(trainer, Rollout(dev, weights=10 * GiB, kv=20 * GiB))
    _cycle(actor, trainer)  # the activations' 35 GiB sit in torch's cache when each switch starts
    up = actor.reports[-2]
    assert up.phase("release_cache") is not None and up.phase("release_cache").bytes >= 35 * GiB
    assert dev.events.index("empty_cache") < dev.events.index("wake weights")
    assert up.phase("offload") is None, "state and rollout engine fit together once the cache went back"


def test_what_the_sync_staged_on_the_device_goes_back_before_the_kv_cache_maps_memory(monkeypatch):
    from gearshift.reshard import StreamingResharder

    class Staging(StreamingResharder):  # loads through a device copy it frees, as the file round trip does
        def sync(self, plan, train, rollout, timer=None):
            report = super().sync(plan, train, rollout, timer)
            dev.alloc(40 * GiB)
            dev.release(40 * GiB)
            return report

    dev = Device(100 * GiB)
    dev.patch(monkeypatch)
    trainer = Trainer(dev, {"params": 20 * GiB, "grads": 0, "optimizer": 20 * GiB}, activations=10 * GiB)
    actor = HybridActor(trainer, Rollout(dev, weights=10 * GiB, kv=35 * GiB), Staging(share=False),
                        offload=["optimizer"])  # the rollout engine sleeps at every switch to train
    _cycle(actor, trainer)  # waking the KV cache found 30 GiB free beside 40 GiB cached: out of memory
    assert all(r.phase("release_cache_after_sync").bytes == 40 * GiB for r in actor.reports[::2])
    assert dev.events.index("export") < dev.events.index("wake kv_cache")


def test_state_moves_only_when_the_rollout_engine_needs_it_and_weights_only_after_the_sync(monkeypatch):
    dev = Device(100 * GiB)
    dev.patch(monkeypatch)
    sizes = {"params": 30 * GiB, "grads": 0, "optimizer": 40 * GiB}
    trainer = Trainer(dev, sizes, activations=20 * GiB)
    actor = HybridActor(trainer, Rollout(dev, weights=10 * GiB, kv=55 * GiB))  # 65 GiB: more than the optimizer frees
    assert trainer.reserved == [("optimizer", "params")]  # what the plan will move, allocated at start
    dev.events.clear()
    _cycle(actor, trainer)
    first = dev.events[: dev.events.index("wake kv_cache") + 1]
    assert first.index("offload optimizer") < first.index("export") < first.index("offload params"), first
    assert trainer.away == set() and dev.allocated == 70 * GiB  # every state back for training


def test_given_tags_have_their_host_buffers_at_start_and_always_move(monkeypatch):
    dev = Device(200 * GiB)
    dev.patch(monkeypatch)
    trainer = Trainer(dev, {"params": 10 * GiB, "grads": 5 * GiB, "optimizer": 20 * GiB}, activations=GiB)
    actor = HybridActor(trainer, Rollout(dev, 5 * GiB, 5 * GiB), offload=["optimizer", "grads"])
    assert trainer.reserved == [("optimizer", "grads")] and actor.host_reserved == 25 * GiB
    _cycle(actor, trainer, 2)
    assert all(r.phase("offload").bytes == 25 * GiB for r in actor.reports[::2])


def test_the_rollout_engine_stays_awake_only_while_training_beside_it_costs_the_trainer_nothing(monkeypatch):
    dev = Device(200 * GiB)
    dev.patch(monkeypatch)

    def run(bound_by_step):
        trainer = Trainer(dev, {"params": 10 * GiB, "grads": 0, "optimizer": 20 * GiB}, activations=10 * GiB)
        actor = HybridActor(trainer, Rollout(dev, weights=5 * GiB, kv=20 * GiB))
        slept = []
        for bound in bound_by_step:
            actor.to_rollout()
            report = actor.to_train()
            slept.append(report.phase("sleep") is not None)
            trainer.step()
            trainer.memory_bound = bound  # what the step's micro-batching found
        dev.mapped = 0  # the next run's rollout engine maps its own
        return slept

    # room for both: the engine stays awake once a training phase has been measured
    assert run([False] * 4) == [True, False, False, False]
    # a trainer sizing its micro-batches by free memory would get smaller ones beside it: it sleeps each time
    assert run([True] * 4) == [True, True, True, True]
    # awake until the micro-batches shrank beside it; then asleep for good, though they grew back asleep
    assert run([False, False, True, False, False]) == [True, False, False, True, True]


def test_activation_estimate_orders_its_cases():
    config = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                             num_key_value_heads=2, head_dim=64, vocab_size=151936)
    train = activation_bytes_per_token(config, training=True)
    assert activation_bytes_per_token(config, training=True, checkpointing=True) < train
    assert activation_bytes_per_token(config, training=False) < train
    # about 3 MiB a token at Qwen2-0.5B's shape: 1.8 MiB its layers, 1.2 MiB the logits and their gradient
    assert 2.5 * 2**20 < train < 3.5 * 2**20


def test_the_default_micro_batches_fit_free_memory_or_say_what_to_change(monkeypatch, gearshift_model):
    from gearshift import memory
    from gearshift.backends.torch_train import TorchTrainEngine
    from gearshift.train import TrainBatch

    engine = TorchTrainEngine.build(gearshift_model)
    per_token = activation_bytes_per_token(engine.hf_model.config, training=True, compute_itemsize=4)  # float32
    batch = TrainBatch.from_sequences([[5] * 10] * 8, [[6] * 30] * 8)  # rows of 40 tokens
    engine.device = torch.device("cuda")  # the budget is worked out for GPUs only; its memory is simulated here
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * GiB))
    margin = 4 * GiB  # 4% of the device
    monkeypatch.setattr(memory, "release_cached", lambda d: 0)
    monkeypatch.setattr(memory, "device_free", lambda d, cached=True: margin + 100 * per_token)
    assert engine.token_budget(batch) == 100  # the step's own gradients are on this CPU's host here: 0 bytes
    assert [len(rows) for _, rows in engine.micro_batches(batch)] == [2, 2, 2, 2]  # 2 rows of 40 a micro-batch
    assert engine.memory_bound  # more memory, fewer micro-batches
    monkeypatch.setattr(memory, "device_free", lambda d, cached=True: margin + 1000 * per_token)
    assert engine.token_budget(batch) == 1000 and not engine.memory_bound  # the whole batch in one
    monkeypatch.setattr(memory, "device_free", lambda d, cached=True: margin + 30 * per_token)
    with pytest.raises(MemoryPlanError, match="rows of 40 tokens need.*gradient_checkpointing=true"):
        engine.token_budget(batch)
    engine.device = torch.device("cpu")
    assert engine.token_budget(batch) == memory.CPU_TOKENS_PER_MICRO_BATCH  # a CPU: packed by length
    assert TorchTrainEngine.build(gearshift_model, micro_batch_size=4).token_budget(batch) is None


def test_tensor_bytes_counts_every_tensor_in_nested_lists_tuples_and_dicts():
    from gearshift.memory import tensor_bytes

    kv = [(torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)), {"k": torch.zeros(5, dtype=torch.int64)}, None]
    assert tensor_bytes(kv) == 2 * 3 * 4 + 4 * 2 + 5 * 8 and tensor_bytes(None) == 0


def test_a_policy_that_cannot_train_with_the_device_to_itself_fails_at_start_naming_its_own_knobs(
        monkeypatch, gearshift_model):
    """`check_train_fits`, as the RL loop calls it right after the policy is built: the step's own test (rows of
    the longest length, the optimizer's update) against the memory free before the rollout engine takes any; the
    message names the engine's own options too. Nothing is asked on a CPU."""
    from gearshift import memory
    from gearshift.backends.torch_train import TorchTrainEngine

    engine = TorchTrainEngine.build(gearshift_model)
    memory.check_train_fits(engine, 40)  # a CPU: nothing to check
    engine.device = torch.device("cuda")  # the device's memory is simulated
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * GiB))
    monkeypatch.setattr(memory, "release_cached", lambda d: 0)
    monkeypatch.setattr(memory, "device_free", lambda d, cached=True: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (30 * GiB, 100 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 68 * GiB)  # all but a context: this run's
    monkeypatch.setattr(engine, "step_bytes", lambda: (GiB, 20 * GiB))
    memory.check_train_fits(engine, 40)  # 20 GiB of update and a 4 GiB margin in 30 GiB free
    monkeypatch.setattr(engine, "step_bytes", lambda: (GiB, 27 * GiB))
    monkeypatch.setattr(engine, "memory_hints", ("partition over more GPUs (train.mesh)",))
    with pytest.raises(MemoryPlanError, match=r"does not fit \(found at start.*update needs 27.0 GiB.*30.0 GiB of "
                                              r"device memory are free.*partition over more GPUs \(train.mesh\)") as err:
        memory.check_train_fits(engine, 40)
    # only what can help: no rollout engine exists yet, and shorter rows do not shrink the optimizer's update
    assert not any(k in str(err.value) for k in ("gpu_memory_utilization", "switch.offload", "max_tokens"))
    assert "held outside this run" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 50 * GiB)  # 18 GiB someone else's
    with pytest.raises(MemoryPlanError, match=r"To change: free the 18.0 GiB of the device held outside this run"):
        memory.check_train_fits(engine, 40)
    assert "model.dtype=bfloat16" in str(err.value)  # float32 weights here
    engine.dtype = torch.bfloat16
    with pytest.raises(MemoryPlanError) as err:
        memory.check_train_fits(engine, 40)
    assert "model.dtype=bfloat16" not in str(err.value)  # bfloat16 already


@pytest.mark.parametrize("arch", ["qwen2", "mixtral", "qwen3_moe"])
def test_the_activation_estimate_is_above_what_autograd_keeps_dense_or_mixture_of_experts(arch, tmp_path):
    """What the forward keeps for backward (every tensor autograd saves that is not a weight), per token, at
    the `small` shape in float32, against `activation_bytes_per_token`: above it, and not by more than 2.5x."""
    from transformers import AutoModelForCausalLM

    from gearshift.models import build_model

    model = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / arch, preset="small", arch=arch))
    model.train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = 256
    ids = torch.randint(0, 300, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).logits.float().log_softmax(-1).gather(-1, ids[..., None]).sum()
    measured = sum(kept.values()) / tokens
    estimate = activation_bytes_per_token(model.config, training=True, compute_itemsize=4)
    assert measured < estimate < 2.5 * measured, (measured, estimate)
