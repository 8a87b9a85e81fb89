"""The suite for any installed pair, by backend names: what `gearshift conformance` runs.

    pytest --pyargs gearshift.conformance.by_name --gearshift-train torch --gearshift-rollout hf
"""

from __future__ import annotations

import json

import pytest

from .. import registry
from .pair import PairSuite
from .rollout import RolloutEngineSuite
from .train import TrainEngineSuite


def _options(config, kind: str) -> dict:
    return json.loads(config.getoption("--gearshift-options")).get(kind, {})


def _name(config, kind: str) -> str:
    name = config.getoption(f"--gearshift-{kind}")
    if not name:
        pytest.skip(f"no --gearshift-{kind} given")
    return name


@pytest.fixture(autouse=True)
def _tolerance(request):
    """`--gearshift-atol` widens the log-probability tolerances (bf16 engines, GPUs)."""
    atol = request.config.getoption("--gearshift-atol")
    if atol is not None and request.instance is not None:
        request.instance.logprob_atol = atol


@pytest.fixture(scope="session")
def named_rollout_engine(request, gearshift_model):
    engine = registry.create("rollout", _name(request.config, "rollout"), model=gearshift_model,
                             **_options(request.config, "rollout"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def named_train_factory(request, gearshift_model):
    name = _name(request.config, "train")
    base = _options(request.config, "train")
    return lambda **kw: registry.create("train", name, model=gearshift_model, **{**base, **kw})


class TestRollout(RolloutEngineSuite):
    backends_from_options = True

    @pytest.fixture
    def rollout_engine(self, named_rollout_engine):
        return named_rollout_engine


class TestTrain(TrainEngineSuite):
    backends_from_options = True

    @pytest.fixture
    def train_engine_factory(self, named_train_factory):
        return named_train_factory


class TestPair(PairSuite):
    backends_from_options = True

    @pytest.fixture(scope="class")
    @classmethod
    def train_engine(cls, named_train_factory):
        engine = named_train_factory(lr=1e-2)
        yield engine
        engine.close()

    @pytest.fixture
    def rollout_engine(self, named_rollout_engine):
        return named_rollout_engine

