"""The conformance suite: contracts every backend, in-tree or third-party, must keep.

Subclass one aggregate class per interface (and `PairSuite` for a train and
rollout pair) in a test module, name the backend it checks, and supply its
fixtures:

    from gearshift.conformance import RolloutEngineSuite

    class TestMyRollout(RolloutEngineSuite):
        rollout_backend = MyEngine

        @pytest.fixture(scope="class")
        @classmethod
        def rollout_engine(cls, gearshift_model):
            return MyEngine.build(gearshift_model)

`gearshift_model` (a tiny fp32 model folder built locally, once per session)
comes with the pytest plugin `gearshift.conformance.plugin`, which a test
suite asks for itself (`pytest_plugins = ["gearshift.conformance.plugin"]` in
its root conftest.py, or `pytest -p gearshift.conformance.plugin`): installing
gearshift changes nothing in anyone else's pytest session. Expected failures are
declared once, on the backend class (`conformance_xfail = {"rollout": {test:
reason}}`), and marked xfail (strict) wherever the suite checks that backend,
in its own tests and under `gearshift conformance` alike.
"""

import importlib

#: public name -> the module of this package that defines it; imported on first use, so that importing
#: `gearshift.conformance.cli` (the `gearshift conformance` command) needs neither pytest nor torch
_EXPORTS = {"PairSuite": "pair", "RolloutEngineSuite": "rollout", "TrainEngineSuite": "train",
            "reference_logprob_diff": "util", "reference_weights": "util"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
