"""Making SGLang importable beside a CPU build of PyTorch, in this process and in SGLang's own.

Three things stand between a CPU torch and `import sglang`, and `prepare()`
handles each, only where it is needed (it is idempotent and runs in every
process that imports SGLang: the host, and SGLang's scheduler and detokenizer
processes through `children.py`):

- `sgl_kernel` has no CPU build: `kernel.install()` puts a stand-in in place
  when no real one imports.
- SGLang imports `triton` and `torchvision` at module level. PyPI's torchvision
  is built against CUDA torch: beside CPU torch its compiled operators cannot
  load, and its Python layer then fails on import ("operator torchvision::nms
  does not exist"). Installed where every process sees it, it breaks
  transformers (which imports torchvision whenever it is installed) and so
  vLLM. They are therefore installed into a folder of their own
  (`private_site()`, filled by tools/install_sglang.sh), which only processes
  that import SGLang put on `sys.path`.
- With its compiled operators missing, torchvision's Python layer still
  registers fake kernels for `nms` and `qnms`, which needs their schemas:
  `declare_torchvision_ops()` declares those two (schemas only; a call raises
  the dispatcher's "no kernel" error). SGLang's text models never call them.

`SGLANG_USE_CPU_ENGINE` must be set before SGLang is imported (it is read
once); `cpu_environment()` gives it with the variables a rollout engine needs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from . import kernel

PRIVATE_SITE_ENV = "GEARSHIFT_SGLANG_SITE"
#: torchvision's operators whose fake kernels its Python layer registers unconditionally
TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_declared: list = []  # torch.library.Library objects must stay alive for their definitions to last


def private_site() -> Path:
    """The folder holding the packages only SGLang's processes see (torchvision, triton)."""
    override = os.environ.get(PRIVATE_SITE_ENV)
    return Path(override) if override else Path(sys.prefix) / "lib" / "gearshift-sglang"


def cpu_environment() -> dict[str, str]:
    """Variables SGLang must see before it is imported, to run its CPU engine with the model's own logprobs."""
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        # logprobs of the model's own distribution, before temperature, top-k and top-p
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
    }


def gpu_environment() -> dict[str, str]:
    """Variables SGLang must see before it is imported, on CUDA: the model's own logprobs, as on the CPU."""
    return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def prepare(on_gpu: bool | None = None) -> dict[str, bool]:
    """Make `import sglang` work here; returns what was done ({"kernel_stand_in": ..., "private_site": ...})."""
    import torch

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    done = {"kernel_stand_in": False, "private_site": False}
    if on_gpu:
        return done
    site = private_site()
    if site.is_dir() and str(site) not in sys.path and _needs(site):
        sys.path.append(str(site))
        importlib.invalidate_caches()
        done["private_site"] = True
    declare_torchvision_ops()
    done["kernel_stand_in"] = kernel.install()
    return done


@contextmanager
def importing_sglang():
    """`prepare()` for the block that imports SGLang; the private site leaves `sys.path` afterwards.

    The packages imported from it stay loaded, and their submodules importable; but spawned
    processes copy the parent's `sys.path` and import its main module before anything of
    gearshift's runs there: with the folder on their path, transformers would meet torchvision
    before its schemas are declared.
    """
    done = prepare()
    try:
        yield done
    finally:
        if done["private_site"] and str(private_site()) in sys.path:
            sys.path.remove(str(private_site()))
            importlib.invalidate_caches()


def _needs(site: Path) -> bool:
    """True if the folder holds a package this process cannot import otherwise."""
    return any((site / name).is_dir() and importlib.util.find_spec(name) is None for name in ("torchvision", "triton"))


def declare_torchvision_ops() -> list[str]:
    """Declare the schemas torchvision's Python layer needs when its compiled operators did not load."""
    import torch

    if importlib.util.find_spec("torchvision") is None:
        return []
    missing = [name for name in TORCHVISION_SCHEMAS if not _has_op("torchvision", name)]
    if not missing or _compiled_torchvision_loads():
        return []
    library = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        library.define(TORCHVISION_SCHEMAS[name])
    _declared.append(library)
    return missing


def _has_op(namespace: str, name: str) -> bool:
    import torch

    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _compiled_torchvision_loads() -> bool:
    """Load torchvision's compiled operators as torchvision itself would; False if they do not fit this torch."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    folder = Path(spec.origin).parent if spec and spec.origin else None
    libraries = sorted(folder.glob("_C*.so")) if folder else []
    if not libraries:
        return False
    try:
        torch.ops.load_library(str(libraries[0]))
    except (OSError, RuntimeError):
        return False
    return _has_op("torchvision", "nms")
