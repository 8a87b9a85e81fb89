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
comes with the pytest plugin this package registers. Expected failures are
declared once, on the backend class (`conformance_xfail = {"rollout": {test:
reason}}`), and marked xfail (strict) wherever the suite checks that backend,
in its own tests and under `gearshift conformance` alike.
"""

from .pair import PairSuite
from .rollout import RolloutEngineSuite
from .train import TrainEngineSuite
from .util import reference_logprob_diff, reference_weights

__all__ = ["PairSuite", "RolloutEngineSuite", "TrainEngineSuite", "reference_logprob_diff", "reference_weights"]
