"""The core's import structure: no circle between its modules or packages, the kernel free of the RL loop.

Read from the source (ast), so every import counts: at module level, under
`TYPE_CHECKING`, and inside functions (a lazy import is a dependency all the
same). The one import let through is the package face's lazy `Trainer`
attribute, which is what keeps `import gearshift` free of the RL loop (checked
in a subprocess below).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gearshift

ROOT = Path(gearshift.__file__).parent
#: around the kernel: the RL loop (and `gearshift.rewards`, the names configs give its rewards), the models
#: built locally, the reference backends, the conformance suite, and the two entry points that use everything
AROUND = ("gearshift.rl", "gearshift.rewards", "gearshift.models", "gearshift.backends", "gearshift.conformance",
          "gearshift.cli", "gearshift.__main__", "gearshift.bench")


def around(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in AROUND)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def lazy_face_import(tree: ast.Module, node: ast.AST) -> bool:
    """The import inside `gearshift/__init__.py`'s module `__getattr__`."""
    return any(isinstance(f, ast.FunctionDef) and f.name == "__getattr__" and node in ast.walk(f)
               for f in tree.body)


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The gearshift modules `name` imports, anywhere in its file; `from pkg import sub` names the submodule."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if name == "gearshift" and lazy_face_import(tree, node):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import gearshift.x.y` as a name, or an attribute path
                target = target.rpartition(".")[0]
            if target.startswith("gearshift") and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def unit(name: str) -> str:
    """The concept a module belongs to: a top-level module, or a subpackage (gearshift.reshard, gearshift.rl)."""
    return ".".join(name.split(".")[:2])


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle in the graph, as the path around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def faceless(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Without the package faces' imports of their own submodules (`gearshift/reshard/__init__.py` gathering
    reshard's names): a face re-exports, it is not a concept that its parts depend back on."""
    return {n: {t for t in ts if not t.startswith(n + ".")} for n, ts in edges.items()}


def test_no_import_circle_between_modules():
    found = cycle(faceless(graph()))
    assert found is None, "an import circle: " + " -> ".join(found)


def package_graph() -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for name, targets in faceless(graph()).items():
        here = unit(name)
        units.setdefault(here, set()).update(unit(t) for t in targets if unit(t) != here and t != "gearshift")
    units.pop("gearshift", None)  # the face imports the kernel's names; nothing in the kernel imports it
    return units


def test_no_import_circle_between_packages():
    """The models package included: the task models are built in the RL loop (`gearshift.rl.presets`) and
    registered with `gearshift.models` by name, which knows nothing of the loop."""
    found = cycle(package_graph())
    assert found is None, "an import circle between packages: " + " -> ".join(found)


def fresh_python(code: str) -> str:
    """What `code` prints in a new interpreter (which must exit cleanly)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_import_gearshift_models_leaves_the_rl_loop_out_and_names_it_for_task_models():
    code = ("import sys\n"
            "from gearshift.models import known_model, resolve_model\n"
            "assert 'gearshift.rl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('gearshift.rl'))\n"
            "assert known_model('tiny-rm') and not known_model('small-add')\n"
            "try:\n    resolve_model('small-add')\nexcept ValueError as e:\n    print(e)\n"
            "import gearshift.rl\n"
            "assert known_model('small-add') and known_model('tiny-add-rm') and not known_model('tiny-nosuch')\n"
            "assert gearshift.rl.resolve_model is resolve_model\n")
    out = fresh_python(code)
    assert "`import gearshift.rl` first" in out, out


def test_nothing_imports_the_package_face():
    """`from gearshift import X` in a kernel module would make it depend on every other (the CLI, which
    uses them all, reads `__version__` there)."""
    users = sorted(n for n, ts in graph().items() if "gearshift" in ts and not around(n))
    assert not users, f"these modules import the package face (import the module that holds the name): {users}"


def test_the_kernel_imports_nothing_from_around_it():
    """Backends and the RL loop build on the kernel, never the other way (the RL loop above all)."""
    offenders = {n: sorted(t for t in ts if around(t)) for n, ts in graph().items() if not around(n)}
    offenders = {n: ts for n, ts in offenders.items() if ts}
    assert not offenders, f"kernel modules import from around the kernel: {offenders}"


def test_the_checks_see_a_circle_and_a_kernel_import_of_rl(tmp_path):
    """The walk itself: a circle made up here is found, and a kernel module importing the loop, even lazily
    or only for type checking, would be caught."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    edges = graph()
    assert "gearshift.weights" in edges["gearshift.train"]
    assert "gearshift.train" in edges["gearshift.reshard.export"]  # a TYPE_CHECKING import counts
    fake = tmp_path / "fake.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .rl import config\n"
                    "def f():\n    from . import dist\n    import gearshift.rl.controller\n")
    assert imports("gearshift.fake", fake, set(modules())) == {
        "gearshift.rl.config", "gearshift.dist", "gearshift.rl.controller"}


def test_import_gearshift_leaves_the_rl_loop_out_and_trainer_still_imports():
    code = ("import sys, gearshift\n"
            "assert 'gearshift.rl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('gearshift.rl'))\n"
            "from gearshift import Trainer\n"
            "import gearshift.rl\n"
            "assert Trainer is gearshift.rl.Trainer\n"
            "try:\n    gearshift.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    assert "no attribute 'no_such_name'" in fresh_python(code)


#: modules still over the limit, each being split (the run config's sections; the bench by what it measures)
LONG = {"gearshift.rl.config", "gearshift.bench"}


def test_no_module_of_the_core_is_over_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items() if n not in LONG}
    over = {n: k for n, k in long.items() if k > 400}
    assert not over, f"split these by concern: {over}"
