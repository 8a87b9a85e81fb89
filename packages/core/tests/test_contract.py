"""The construction contract and the semantics every engine keeps, and the suite catching engines that break them."""

import copy
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import gearshift as gs
from gearshift import registry
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.cli import main
from gearshift.mesh import MeshSpec
from gearshift.options import EngineError, OptionError, describe, option
from gearshift.reshard import plan_reshard
from gearshift.rollout import Rollout
from gearshift.train import TrainBatch, nll_loss
from gearshift.weights import WeightBucket, WeightError, WeightSpec


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def test_unknown_options_and_wrong_types_are_clear_errors(gearshift_model):
    with pytest.raises(OptionError, match=r"rollout backend 'hf': HFRolloutEngine has no option 'max_batchsize'.*"
                                          r"max_model_len.*also takes: device, max_batch_size"):
        gs.create("rollout", "hf", model=gearshift_model, max_batchsize=8)
    with pytest.raises(OptionError, match=r"option 'lr' = 'fast' \(str\): expected float"):
        TorchTrainEngine.build(gearshift_model, lr="fast")
    with pytest.raises(OptionError, match="option 'dtype' = 'float8'.*use one of"):
        TorchTrainEngine.build(gearshift_model, dtype="float8")
    with pytest.raises(OptionError, match="option 'mesh': bad mesh 'dp:2': write it as 'dp=4,tp=2'"):
        TorchTrainEngine.build(gearshift_model, mesh="dp:2")
    assert main(["train", f"model.path={gearshift_model}", "rollout.backend=hf", "train.backend=torch",
                 "rollout.options.max_batchsize=8", "run.progress=false"]) == 2


def test_options_are_typed_and_listed_by_the_cli(capsys):
    rows = {r[1]: r for r in describe(HFRolloutEngine)}
    assert rows["max_batch_size"][2:4] == ("int", "64") and rows["max_model_len"][2] == "int | None"
    assert rows["model"][0] == "common" and rows["device"][0] == "own"
    assert main(["backends", "hf"]) == 0
    out = capsys.readouterr().out
    assert "max_batch_size" in out and "every rollout engine" in out and "64" in out
    assert main(["backends", "fsdp"]) == 0 and "reshard_after_forward" in capsys.readouterr().out
    assert main(["backends", "stream"]) == 0 and "share" in capsys.readouterr().out


def test_an_engine_that_sets_no_context_length_is_refused_at_build(gearshift_model):
    class NoContext(HFRolloutEngine):
        def __init__(self, args, options=None):
            super().__init__(args, options)
            del self.max_model_len

    registry.register("rollout", "no-context", NoContext)
    with pytest.raises(EngineError, match=r"rollout backend 'no-context'.*max_model_len must be a positive int"):
        gs.create("rollout", "no-context", model=gearshift_model)


def test_malformed_options_are_refused_when_registered():
    class NoDefault(HFRolloutEngine):
        @dataclass(frozen=True)
        class Options:
            size: int

    class Shadows(HFRolloutEngine):
        @dataclass(frozen=True)
        class Options:
            seed: int = option(1, "a second seed")

    with pytest.raises(registry.BackendError, match="Options.size has no default"):
        registry.register("rollout", "no-default", NoDefault)
    with pytest.raises(registry.BackendError, match="shadows the common argument 'seed'"):
        registry.register("rollout", "shadows", Shadows)


def test_two_plugins_under_one_name_are_picked_by_package(gearshift_model):
    from stevedore import ExtensionManager
    from stevedore.extension import Extension
    import importlib.metadata as md

    exts = [Extension("hf", md.EntryPoint("hf", "pkg_a.x:A", "gearshift.rollout"), HFRolloutEngine, None),
            Extension("hf", md.EntryPoint("hf", "pkg_b.y:B", "gearshift.rollout"), TorchTrainEngine, None)]
    registry.use_manager("rollout", ExtensionManager.make_test_instance(exts))
    with pytest.raises(registry.BackendError, match="defined by both pkg_a and pkg_b: name one as 'pkg_a:hf' or 'pkg_b:hf'"):
        registry.load("rollout", "hf")
    assert registry.load("rollout", "pkg_a:hf") is HFRolloutEngine
    with pytest.raises(registry.BackendError, match="not a subclass of RolloutEngine"):
        registry.load("rollout", "pkg_b:hf")


def test_a_tied_head_plans_and_loads_under_either_name(gearshift_model):
    train = TorchTrainEngine.build(gearshift_model)
    rollout = HFRolloutEngine.build(gearshift_model)
    spec = train.weight_spec()
    assert spec.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in spec.names()
    # a trainer that lists the head under its other name still plans against the rollout engine
    renamed = WeightSpec(spec.mesh, tuple(
        p.__class__("lm_head.weight", p.shape, p.dtype, p.placement) if p.name == "model.embed_tokens.weight" else p
        for p in spec.params), {})
    plan = plan_reshard(renamed, rollout.weight_spec())
    assert plan.source_names["model.embed_tokens.weight"] == "lm_head.weight"
    head = train.local_weights(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    assert rollout.weight_spec().check({"lm_head.weight": head}) .keys() == {"model.embed_tokens.weight"}
    with pytest.raises(WeightError, match="both sent with different values"):
        rollout.weight_spec().check({"lm_head.weight": head, "model.embed_tokens.weight": head + 1})


def test_trainers_train_with_dropout_off_unless_asked(tmp_path):
    from gearshift.models import build_model

    path = build_model(tmp_path / "dropout", preset="tiny")
    config = (tmp_path / "dropout" / "config.json")
    config.write_text(config.read_text().replace('"attention_dropout": 0.0', '"attention_dropout": 0.5'))
    batch = TrainBatch.from_sequences([[72, 101, 108], [49, 43]], [[108, 111, 33, 9], [50, 61, 9]])

    def step_vs_eval(dropout: bool) -> float:
        engine = TorchTrainEngine.build(path, dropout=dropout, lr=0.0)
        ref, _ = nll_loss(engine.forward_logprobs(batch, with_entropy=True), batch)
        return abs(engine.train_step(batch, nll_loss)["loss"] - float(ref))

    assert step_vs_eval(dropout=False) < 1e-6  # the loss trained on is the loss of the model that sampled
    assert step_vs_eval(dropout=True) > 1e-3


def test_backends_into_a_closed_pipe_ends_quietly():
    proc = subprocess.run(f"{sys.executable} -m gearshift backends | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("kind") and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


# --- engines that break the contract, and the suite failing them --------------------------------
class TemperedLogprobs(HFRolloutEngine):
    """Reports the logprobs of the distribution it sampled from (temperature applied): wrong."""

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        if sampling.greedy or sampling.temperature == 1.0:
            return out
        with torch.no_grad():
            for r in out:
                ids = torch.tensor([r.prompt_ids + r.token_ids], device=self.device)
                logits = self.model(ids).logits[0, len(r.prompt_ids) - 1:-1].float() / sampling.temperature
                r.logprobs = torch.log_softmax(logits, -1).gather(
                    -1, torch.tensor(r.token_ids, device=self.device)[:, None]).squeeze(-1).tolist()
        return out


class PrefixCaching(HFRolloutEngine):
    """hf with a real prefix cache for greedy requests: each prompt's keys and values, kept between calls."""

    drops_cache = True

    def __init__(self, args, options=None):
        super().__init__(args, options)
        self._prefixes = {}

    @torch.no_grad()
    def _generate(self, prompts, sampling, offset):
        if not sampling.greedy or sampling.n != 1:
            return super()._generate(prompts, sampling, offset)
        out = []
        for i, p in enumerate(prompts):
            if tuple(p) not in self._prefixes:
                self._prefixes[tuple(p)] = self.model(torch.tensor([p[:-1]], device=self.device),
                                                      use_cache=True).past_key_values
            cache, token, tokens, logprobs = copy.deepcopy(self._prefixes[tuple(p)]), p[-1], [], []
            for pos in range(len(p) - 1, min(len(p) - 1 + sampling.max_tokens, self.max_model_len - 1)):
                res = self.model(torch.tensor([[token]], device=self.device), past_key_values=cache, use_cache=True,
                                 position_ids=torch.tensor([[pos]], device=self.device))
                logp = torch.log_softmax(res.logits[0, -1].float(), -1)
                token, cache = int(logp.argmax()), res.past_key_values
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if token == self.tokenizer.eos_token_id:
                    break
            reason = "stop" if tokens[-1] == self.tokenizer.eos_token_id else "length"
            out.append(Rollout(list(p), tokens, logprobs, reason, prompt_index=offset + i))
        return out

    def reset_cache(self):
        if self.drops_cache:
            self._prefixes.clear()


class StaleCache(PrefixCaching):
    """Keeps cached prefixes across weight changes: wrong."""

    drops_cache = False


def _suite(name, cls, tests):
    registry.register("rollout", name, cls)
    return main(["conformance", "--rollout", name, "--", "-k", tests, "-p", "no:randomly"])


def test_the_suite_fails_an_engine_with_tempered_logprobs():
    tests = "temperature_one or logprobs_agree"
    assert _suite("tempered", TemperedLogprobs, tests) == 1
    assert _suite("plain-hf", HFRolloutEngine, tests) == 0


def test_the_suite_fails_an_engine_that_keeps_a_stale_prefix_cache():
    tests = "prefix_cache"
    assert _suite("prefix-caching", PrefixCaching, tests) == 0  # a correct prefix cache passes
    assert _suite("stale-cache", StaleCache, tests) == 1


def test_the_suite_fails_an_engine_that_ignores_updates():
    class IgnoresUpdates(HFRolloutEngine):
        def update_weights(self, buckets):
            return sum(b.nbytes for b in buckets)

    assert _suite("ignores-updates", IgnoresUpdates, "update_weights") == 1


def test_the_rollout_mesh_must_cover_the_train_mesh_ranks():
    spec = WeightSpec.from_tensors({"w": torch.zeros(4, 4)}, MeshSpec(dp=2))
    with pytest.raises(WeightError, match="both must cover the same ranks"):
        plan_reshard(spec, WeightSpec.from_tensors({"w": torch.zeros(4, 4)}, MeshSpec(dp=4)))


def test_conformance_with_an_unknown_model_fails_once_before_pytest(capsys):
    assert main(["conformance", "--train", "torch", "--rollout", "hf", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-model' is neither a folder nor a preset" in err and "passed" not in err
