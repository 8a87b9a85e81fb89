import importlib.metadata as md

import pytest
from stevedore import ExtensionManager
from stevedore.extension import Extension

from gearshift import registry
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.registry import BackendError


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def ep(name, value, group="gearshift.rollout"):
    return md.EntryPoint(name, value, group)


def test_installed_reference_backends_load_by_short_name():
    assert registry.load("rollout", "hf") is HFRolloutEngine
    assert registry.load("train", "torch") is TorchTrainEngine
    names = {(b.kind, b.name) for b in registry.list_backends() if b.ready}
    assert {("rollout", "hf"), ("train", "torch"), ("reshard", "stream"), ("reshard", "naive")} <= names
    assert registry.ready("rollout", "hf") and registry.ready("train", "torch")
    assert not registry.ready("train", "nope") and not registry.ready("rollout", "torch")


def test_missing_backend_names_the_package_to_install(monkeypatch):
    registry.use_manager("train", ExtensionManager.make_test_instance([]))
    monkeypatch.setitem(registry.KNOWN_PACKAGES, ("train", "megatron"),
                        ("gearshift-megatron-not-a-real-dist", "pip install gearshift-megatron-not-a-real-dist"))
    with pytest.raises(BackendError, match="not installed: pip install gearshift-megatron-not-a-real-dist"):
        registry.load("train", "megatron")
    # an installed package that registers no engine says so rather than asking for an install
    monkeypatch.setitem(registry.KNOWN_PACKAGES, ("train", "stevedore-engine"), ("stevedore", "pip install stevedore"))
    with pytest.raises(BackendError, match="stevedore is installed but registers no engine yet"):
        registry.load("train", "stevedore-engine")
    with pytest.raises(BackendError, match="no train backend named 'nope'"):
        registry.load("train", "nope")
    with pytest.raises(BackendError, match="unknown backend kind"):
        registry.load("trainer", "torch")


def test_plugin_that_fails_to_import_says_so():
    failure = (ep("broken", "broken_pkg.engine:Engine"), ImportError("No module named 'broken_dep'"))
    registry.use_manager("rollout", ExtensionManager.make_test_instance([]), [failure])
    rows = {b.name: b for b in registry.list_backends("rollout")}
    assert "broken_dep" in rows["broken"].status
    assert not registry.ready("rollout", "broken")
    with pytest.raises(BackendError, match="cannot be loaded: ImportError: No module named 'broken_dep'"):
        registry.load("rollout", "broken")


def test_two_plugins_with_one_name_is_an_error_naming_both():
    exts = [Extension("hf", ep("hf", "pkg_a.x:A"), HFRolloutEngine, None),
            Extension("hf", ep("hf", "pkg_b.y:B"), HFRolloutEngine, None)]
    registry.use_manager("rollout", ExtensionManager.make_test_instance(exts))
    with pytest.raises(BackendError, match="defined by both pkg_a and pkg_b"):
        registry.load("rollout", "hf")


def test_wrong_kind_and_missing_engine_requirements():
    class NeedsEngine(TorchTrainEngine):
        requires = ("no-such-distribution-xyz|nor-this-one",)
        install = "pip install my-engine"

    exts = [Extension("odd", ep("odd", "m:X", "gearshift.train"), dict, None),
            Extension("needy", ep("needy", "m:Y", "gearshift.train"), NeedsEngine, None)]
    registry.use_manager("train", ExtensionManager.make_test_instance(exts))
    with pytest.raises(BackendError, match="not a subclass of TrainEngine"):
        registry.load("train", "odd")
    with pytest.raises(BackendError, match="needs no-such-distribution-xyz or nor-this-one: pip install my-engine"):
        registry.load("train", "needy")


def test_register_a_backend_from_user_code():
    class Mine(HFRolloutEngine):
        pass

    registry.register("rollout", "mine", Mine)
    assert registry.load("rollout", "mine") is Mine
    with pytest.raises(BackendError, match="already exists"):
        registry.register("rollout", "hf", Mine)
    with pytest.raises(BackendError, match="must subclass RolloutEngine"):
        registry.register("rollout", "bad", TorchTrainEngine)


def test_a_backend_written_for_another_contract_is_refused_naming_both_versions():
    from gearshift.contract import VERSION
    from gearshift.rollout import RolloutArgs

    class Ported(HFRolloutEngine):
        contract = VERSION

    class Older(HFRolloutEngine):
        contract = VERSION - 1

    registry.register("rollout", "ported-hf", Ported)  # its declared version is this core's
    with pytest.raises(BackendError, match=rf"written for backend contract {VERSION - 1} .*this gearshift "
                                           rf"implements contract {VERSION} .*CHANGELOG.md.*Writing a backend"):
        registry.register("rollout", "older-hf", Older)

    class FirstShape(HFRolloutEngine):  # undeclared, but built the way contract 1 built engines
        def __init__(self, model, *, dtype="float32", device=None):
            pass

    with pytest.raises(BackendError, match=r"must take \(args, options\); it takes \(model, dtype, device\), the "
                                           r"shape of backend contract 1.*CHANGELOG.md"):
        registry.register("rollout", "first-shape", FirstShape)
    assert RolloutArgs  # the args every rollout engine is built from today
