"""Finding backends: stevedore over the entry-point groups `gearshift.rollout|train|reshard`.

Every failure here becomes an error that says what to do: a backend that is
not installed names the package to install, a plugin that fails to import
shows its error (it is never skipped silently), two plugins under one name
name both packages and how to pick one (`package:name`, e.g.
`gearshift-vllm:vllm`), an engine class whose options are malformed says
what is wrong. `register` adds a backend defined in the user's own code,
checked the same way. `create` builds an engine through the construction
contract (gearshift.options).
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any

from stevedore import ExtensionManager

from .options import EngineError, OptionError, check_engine_class
from .reshard import Resharder
from .rollout import RolloutEngine
from .train import TrainEngine

KINDS = {"rollout": RolloutEngine, "train": TrainEngine, "reshard": Resharder}

#: backends that live in this repository's packages, so a missing one can be named
KNOWN_PACKAGES = {
    ("rollout", "vllm"): ("gearshift-vllm", "pip install 'gearshift-vllm[cpu]' (CPU) or 'gearshift-vllm[gpu]'"),
    ("rollout", "sglang"): ("gearshift-sglang", "pip install gearshift-sglang"),
    ("train", "fsdp"): ("gearshift-fsdp", "pip install gearshift-fsdp"),
    ("train", "deepspeed"): ("gearshift-deepspeed", "pip install gearshift-deepspeed"),
}


class BackendError(LookupError):
    """A backend that cannot be had: not installed, broken, ambiguous, or of the wrong kind."""


@dataclass
class BackendInfo:
    """One row of `gearshift backends`."""

    kind: str
    name: str
    package: str
    cls: type | None = None
    error: str | None = None  # import failure or conflict
    missing: list[str] = field(default_factory=list)  # distributions its engine needs
    install: str = ""
    placeholder: bool = False  # the package is installed but registers no engine of this name

    @property
    def ready(self) -> bool:
        return self.cls is not None and self.error is None and not self.missing

    @property
    def status(self) -> str:
        if self.error:
            return f"broken: {self.error}"
        if self.cls is None:
            return self.install if self.placeholder else f"not installed: {self.install}"
        if self.missing:
            hint = f"; {self.install}" if self.install else ""
            return f"needs {', '.join(self.missing)}{hint}"
        return "ready"


_local: dict[tuple[str, str], type] = {}
_managers: dict[str, tuple[ExtensionManager, list[tuple[Any, BaseException]]]] = {}


def _check_kind(kind: str) -> type:
    if kind not in KINDS:
        raise BackendError(f"unknown backend kind {kind!r}; kinds are {sorted(KINDS)}")
    return KINDS[kind]


def _manager(kind: str):
    if kind not in _managers:
        failures: list[tuple[Any, BaseException]] = []
        mgr = ExtensionManager(
            f"gearshift.{kind}", on_load_failure_callback=lambda _m, ep, err: failures.append((ep, err))
        )
        _managers[kind] = (mgr, failures)
    return _managers[kind]


def use_manager(kind: str, manager: ExtensionManager, failures: list | None = None) -> None:
    """Replace the plugins seen for `kind` (tests: `ExtensionManager.make_test_instance`)."""
    _check_kind(kind)
    _managers[kind] = (manager, failures or [])


def reset() -> None:
    """Forget loaded plugins and local registrations (rescan entry points next time)."""
    _managers.clear()
    _local.clear()


def _package_of(kind: str, ep) -> str:
    dist = getattr(ep, "dist", None)
    if dist is not None:
        return dist.name
    for candidate in md.entry_points(group=f"gearshift.{kind}"):
        if candidate.name == ep.name and candidate.value == ep.value and candidate.dist is not None:
            return candidate.dist.name
    return ep.value.split(":")[0].split(".")[0]


def missing_requirements(cls: type) -> list[str]:
    """Distributions in `cls.requires` that are not installed ("a|b": either will do)."""
    missing = []
    for req in getattr(cls, "requires", ()):
        options = req.split("|")
        for dist in options:
            try:
                md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
        else:
            missing.append(" or ".join(options))
    return missing


def class_problem(kind: str, cls: Any) -> str | None:
    """Why `cls` cannot be a backend of `kind` (None: it can)."""
    base = KINDS[kind]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return f"{cls!r} is not a subclass of {base.__name__}"
    if kind != "reshard":
        try:
            check_engine_class(cls)
        except EngineError as err:
            return str(err)
    return None


def _info(kind: str, name: str, cls: type, package: str) -> BackendInfo:
    problem = class_problem(kind, cls)
    if problem:
        return BackendInfo(kind, name, package, error=problem)
    return BackendInfo(kind, name, package, cls, missing=missing_requirements(cls),
                       install=getattr(cls, "install", ""))


def list_backends(kind: str | None = None) -> list[BackendInfo]:
    """Every backend of `kind` (or of all kinds): installed, broken, or known and not installed."""
    kinds = [kind] if kind else list(KINDS)
    rows: list[BackendInfo] = []
    for k in kinds:
        _check_kind(k)
        mgr, failures = _manager(k)
        by_name: dict[str, list[BackendInfo]] = {}
        for ext in mgr.extensions:
            by_name.setdefault(ext.name, []).append(_info(k, ext.name, ext.plugin, _package_of(k, ext.entry_point)))
        for ep, err in failures:
            by_name.setdefault(ep.name, []).append(
                BackendInfo(k, ep.name, _package_of(k, ep), error=f"{type(err).__name__}: {err}")
            )
        for (kk, name), cls in _local.items():
            if kk == k:
                by_name.setdefault(name, []).append(_info(k, name, cls, f"(registered in {cls.__module__})"))
        for name, infos in sorted(by_name.items()):
            if len(infos) > 1:
                packages = sorted(i.package for i in infos)
                picks = " or ".join(f"'{p}:{name}'" for p in packages)
                rows.append(BackendInfo(k, name, " and ".join(packages), error=(
                    f"{k} backend {name!r} is defined by both {' and '.join(packages)}: name one as {picks}")))
                rows.extend(BackendInfo(i.kind, f"{i.package}:{name}", i.package, i.cls, i.error, i.missing,
                                        i.install) for i in infos)
            else:
                rows.append(infos[0])
        for (kk, name), (package, install) in KNOWN_PACKAGES.items():
            if kk == k and name not in by_name:
                try:
                    md.version(package)
                    rows.append(BackendInfo(k, name, package, placeholder=True,
                                            install=f"package installed; it registers no engine yet ({name} is "
                                                    f"future work)"))
                except md.PackageNotFoundError:
                    rows.append(BackendInfo(k, name, package, install=install))
    return rows


def ready(kind: str, name: str) -> bool:
    """Whether backend `name` of `kind` is installed and can be built here (`load` says why not)."""
    return any(r.name == name and r.ready for r in list_backends(kind))


def load(kind: str, name: str) -> type:
    """The class of backend `name` of `kind` ('package:name' picks among plugins that share a name);
    a `BackendError` says why it cannot be had."""
    _check_kind(kind)
    rows = list_backends(kind)
    info = next((r for r in rows if r.name == name), None)
    if info is None and ":" in name:  # 'package:name' of a name only one package defines
        package, _, short = name.rpartition(":")
        info = next((r for r in rows if r.name == short and r.package == package), None)
    if info is None:
        names = sorted({r.name for r in list_backends(kind) if r.cls is not None})
        raise BackendError(f"no {kind} backend named {name!r}; installed: {names or 'none'}")
    if info.error:
        raise BackendError(f"{kind} backend {name!r} ({info.package}) cannot be loaded: {info.error}")
    if info.cls is None and info.placeholder:
        raise BackendError(f"{kind} backend {name!r}: {info.package} is installed but registers no engine yet")
    if info.cls is None:
        raise BackendError(f"{kind} backend {name!r} is not installed: {info.install}")
    if info.missing:
        raise BackendError(
            f"{kind} backend {name!r} ({info.package}) needs {', '.join(info.missing)}"
            + (f": {info.install}" if info.install else "")
        )
    return info.cls


def create(kind: str, name: str, **options: Any):
    """Load backend `name` of `kind` and build it with `options` (an engine: `model=` plus its options)."""
    cls = load(kind, name)
    if kind == "reshard":
        try:
            return cls(**options)
        except TypeError as err:
            raise BackendError(f"reshard backend {name!r}: {err}") from None
    if "model" not in options:
        raise BackendError(f"{kind} backend {name!r} needs model=PATH (a local Hugging Face folder)")
    try:
        return cls.build(options.pop("model"), **options)
    except (OptionError, EngineError) as err:
        raise type(err)(f"{kind} backend {name!r}: {err}") from None


def register(kind: str, name: str, cls: type) -> None:
    """Add a backend defined in your own code (a notebook, a test) under `name`."""
    base = _check_kind(kind)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise BackendError(f"cannot register {cls!r} as a {kind} backend: it must subclass {base.__name__}")
    problem = class_problem(kind, cls)
    if problem:
        raise BackendError(f"cannot register {cls.__name__} as {kind} backend {name!r}: {problem}")
    for info in list_backends(kind):
        if info.name == name and (info.cls is not None or info.error) and info.cls is not cls:
            raise BackendError(f"{kind} backend {name!r} already exists (from {info.package}); pick another name")
    _local[(kind, name)] = cls


def name_of(kind: str, cls: type) -> str | None:
    """The name `cls` (or the nearest registered class it derives from) is registered under."""
    rows = [r for r in list_backends(kind) if r.cls is not None]
    for klass in cls.__mro__:
        for r in rows:
            if r.cls is klass:
                return r.name
    return None


def unregister(kind: str, name: str) -> None:
    _local.pop((kind, name), None)
