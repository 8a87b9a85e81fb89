"""The CPU import path: the sgl_kernel stand-in and the preparation SGLang's processes run first.

These run without starting an engine; the ones that import SGLang are skipped where it is not installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from gearshift_sglang import kernel
from gearshift_sglang.imports import TORCHVISION_SCHEMAS, private_site

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")


def run(code: str) -> str:
    """Run `code` in a fresh interpreter (imports and sys.modules are process-wide) and return its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_stand_in_holds_every_name_and_refuses_calls(tmp_path, monkeypatch):
    module = kernel.build()
    trace = tmp_path / "calls.txt"
    monkeypatch.setenv(kernel.TRACE_ENV, str(trace))
    for name in kernel.IMPORTED:
        with pytest.raises(NotImplementedError, match=name):
            getattr(module, name)(torch.zeros(1))
    assert [line.split()[1] for line in trace.read_text().splitlines()] == list(kernel.IMPORTED)


def test_stand_in_is_installed_only_where_no_real_kernel_imports(tmp_path):
    fake = tmp_path / "sgl_kernel"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    out = run(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from gearshift_sglang import kernel
        print(kernel.install(), kernel.real_kernel_available())
        import sgl_kernel
        print(getattr(sgl_kernel, "REAL", False))
    """)
    assert out.split() == ["False", "True", "True"]
    if importlib.util.find_spec("sgl_kernel") is None:
        out = run("""
            from gearshift_sglang import kernel
            print(kernel.install(), kernel.install(), kernel.real_kernel_available())
            import sgl_kernel
            print(sgl_kernel.__gearshift_stand_in__)
        """)
        assert out.split() == ["True", "True", "False", "True"]


@needs_sglang
def test_sglang_imports_nothing_from_sgl_kernel_beyond_the_stand_in():
    """Every module the CPU engine loads imports; the names it asked of sgl_kernel are the stand-in's."""
    if kernel.real_kernel_available():
        pytest.skip("a real sgl_kernel is installed")
    out = run("""
        import os, sys
        from gearshift_sglang.imports import cpu_environment, prepare
        os.environ.update(cpu_environment())
        prepare()
        asked = set()
        stand_in = sys.modules["sgl_kernel"]
        class Watch(type(stand_in)):
            def __getattribute__(self, name):
                if not name.startswith("__"):
                    asked.add(name)
                return super().__getattribute__(name)
        stand_in.__class__ = Watch
        import sglang.srt.entrypoints.engine, sglang.srt.managers.scheduler, sglang.srt.managers.detokenizer_manager
        import sglang.srt.model_executor.model_runner, sglang.srt.models.qwen2, sglang.srt.models.llama
        print(" ".join(sorted(asked)))
    """)
    assert set(out.split()) <= set(kernel.IMPORTED), f"SGLang asks for {set(out.split()) - set(kernel.IMPORTED)}"


@needs_sglang
def test_torchvision_imports_after_prepare():
    out = run("""
        from gearshift_sglang.imports import prepare
        print(prepare())
        import torch, torchvision.transforms
        print(all(hasattr(torch.ops.torchvision, n) for n in %r))
    """ % (list(TORCHVISION_SCHEMAS),))
    assert out.splitlines()[-1] == "True"


def test_private_site_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("GEARSHIFT_SGLANG_SITE", raising=False)
    assert private_site() == __import__("pathlib").Path(sys.prefix) / "lib" / "gearshift-sglang"
    monkeypatch.setenv("GEARSHIFT_SGLANG_SITE", str(tmp_path))
    assert private_site() == tmp_path
