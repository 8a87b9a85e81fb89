"""This repository's own pytest set-up: the conformance plugin, and the `slow` and `gpu` markers.

The plugin is asked for here, as any backend's tests ask for it; installing
gearshift registers nothing with pytest.
"""

import pytest

pytest_plugins = ["gearshift.conformance.plugin"]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: long-running; skipped unless --runslow")


def pytest_collection_modifyitems(config, items):
    import torch

    has_gpu = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("slow") and not config.getoption("--runslow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow"))
