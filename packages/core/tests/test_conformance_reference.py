"""The reference backends (`torch` train, `hf` rollout) through the conformance suite."""

import pytest

from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance import PairSuite, RolloutEngineSuite, TrainEngineSuite


@pytest.fixture(scope="module")
def hf_engine(gearshift_model):
    return HFRolloutEngine.build(gearshift_model)


class TestHFRollout(RolloutEngineSuite):
    rollout_backend = HFRolloutEngine
    @pytest.fixture
    def rollout_engine(self, hf_engine):
        return hf_engine


class TestTorchTrain(TrainEngineSuite):
    """Also checks that the suite closes every engine a test builds: one merely dropped may stay on the device
    (ZeRO-3 keeps its model on a module-level stack), and the next test's engine would not fit beside it."""
    train_backend = TorchTrainEngine
    built: list = []

    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        def build(**kw):
            engine = TorchTrainEngine.build(gearshift_model, **kw)
            close = engine.close
            engine.closed = False

            def closing():
                engine.closed = True
                close()

            engine.close = closing
            self.built.append(engine)
            return engine

        return build

    @pytest.fixture(autouse=True)
    def _every_engine_closed(self):  # set up before new_train_engine, so torn down after it
        self.built.clear()
        yield
        assert self.built and all(e.closed for e in self.built), \
            f"{sum(not e.closed for e in self.built)} of {len(self.built)} engines left open"


class TestTorchHFPair(PairSuite):
    train_backend, rollout_backend = TorchTrainEngine, HFRolloutEngine
    @pytest.fixture(scope="class")
    @classmethod
    def train_engine(cls, gearshift_model):
        return TorchTrainEngine.build(gearshift_model, lr=1e-2)

    @pytest.fixture
    def rollout_engine(self, hf_engine):
        return hf_engine


def test_unseeded_sampling_moves_on_and_seeded_sampling_repeats(gearshift_model):
    from gearshift import SamplingParams

    hf_engine = HFRolloutEngine.build(gearshift_model)  # its own: the pair tests leave the shared one asleep

    prompts = [[72, 101, 108, 108, 111]]
    free = SamplingParams(n=4, temperature=1.0, max_tokens=6)
    a, b = hf_engine.generate(prompts, free), hf_engine.generate(prompts, free)
    assert [r.token_ids for r in a] != [r.token_ids for r in b]
    seeded = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=7)
    assert [r.token_ids for r in hf_engine.generate(prompts, seeded)] == \
        [r.token_ids for r in hf_engine.generate(prompts, seeded)]
