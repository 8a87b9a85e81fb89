"""The conformance plugin is opt-in: another project's pytest session is its own; a suite that asks for the plugin
gets its fixtures, and the mistakes a backend's tests can make are named."""

import subprocess
import sys
import textwrap

import pytest


def _pytest(project, *args):
    """pytest in `project` (its own rootdir), as that project's developer would run it."""
    (project / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *args], cwd=project, capture_output=True,
                          text=True, timeout=300)


def test_installing_gearshift_changes_nothing_in_another_projects_pytest(tmp_path):
    # a common idiom: the project defines --runslow and a slow marker of its own
    (tmp_path / "conftest.py").write_text(textwrap.dedent('''
        import pytest

        def pytest_addoption(parser):
            parser.addoption("--runslow", action="store_true", default=False)

        def pytest_configure(config):
            config.addinivalue_line("markers", "slow: slow")

        def pytest_collection_modifyitems(config, items):
            if not config.getoption("--runslow"):
                for item in items:
                    if "slow" in item.keywords:
                        item.add_marker(pytest.mark.skip(reason="the project's own skip"))
    '''))
    (tmp_path / "test_mine.py").write_text(textwrap.dedent('''
        import sys
        import pytest

        def test_nothing_of_gearshift_is_loaded(pytestconfig):
            assert "torch" not in sys.modules and "gearshift" not in sys.modules
            assert not [p for p in pytestconfig.pluginmanager.get_plugins()
                        if getattr(p, "__name__", "").startswith("gearshift")]

        @pytest.mark.slow
        def test_slow():
            pass
    '''))
    quick = _pytest(tmp_path)
    assert quick.returncode == 0, quick.stdout + quick.stderr
    assert "1 passed, 1 skipped" in quick.stdout and "the project's own skip" in quick.stdout, quick.stdout
    everything = _pytest(tmp_path, "--runslow")
    assert everything.returncode == 0 and "2 passed" in everything.stdout, everything.stdout + everything.stderr


SUITE = '''
    import pytest
    from gearshift.conformance import RolloutEngineSuite
    from gearshift.backends.hf_rollout import HFRolloutEngine

    class TestMine(RolloutEngineSuite):
        rollout_backend = HFRolloutEngine
    {body}
'''


def _suite_project(tmp_path, body: str):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["gearshift.conformance.plugin"]\n')
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE).format(body=textwrap.indent(body, "    ")))


def test_a_suite_without_its_fixture_says_what_to_write(tmp_path):
    _suite_project(tmp_path, "")
    run = _pytest(tmp_path, "-k", "test_generate_shapes")
    assert run.returncode == 1
    assert "TestMine must supply the fixture rollout_engine" in run.stdout, run.stdout
    assert "def rollout_engine(cls, gearshift_model)" in run.stdout


@pytest.mark.parametrize("attr", ["expected_failures", "conformance_xfail"])
def test_a_suite_declaring_its_own_expected_failures_is_refused(tmp_path, attr):
    _suite_project(tmp_path, f"{attr} = {{'test_sleep_frees_memory': 'nothing to free'}}\n")
    run = _pytest(tmp_path, "-k", "test_generate_shapes")
    assert run.returncode == 4, run.stdout + run.stderr  # a usage error: nothing ran
    assert f"TestMine.{attr} is not read" in run.stderr and "conformance_xfail" in run.stderr, run.stderr
