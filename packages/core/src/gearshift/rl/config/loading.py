"""Filling a `Config`: defaults, then a YAML file, then overrides, every error naming the key and its source."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import ConfigError, choice_problem, choices_of, is_optional, section_hints, section_of
from .root import Config


def normalise(values: Mapping, section: type = Config) -> dict:
    """`values` bound for `section`, in today's spelling: 0 or '' for a key that takes null (unset) is null,
    as older configs wrote it; a bare YAML on / off, which YAML reads as a boolean, is the word for a key
    that takes it (`switch.share: off`)."""
    hints = section_hints(section)
    out = {}
    for key, value in values.items():
        hint = hints.get(key)
        if section_of(hint) is not None and isinstance(value, Mapping):
            value = normalise(value, section_of(hint))
        elif is_optional(hint) and isinstance(value, (int, float, str)) and not isinstance(value, bool) \
                and value in (0, ""):
            value = None
        elif isinstance(value, bool) and {"on", "off"} <= set(choices_of(hint) or ()):
            value = "on" if value else "off"
        out[key] = value
    return out


def _hint(dotted: str) -> Any:
    """The type of key `dotted` ('run.pools.device'), or None."""
    node: Any = Config
    for part in dotted.split("."):
        if section_of(node) is None:
            return None
        node = section_hints(node).get(part)
    return node


def _config_error(err: Exception, where: str) -> ConfigError:
    """An OmegaConf error as a `ConfigError` naming the key, the values it takes, and where it came from."""
    import dataclasses

    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(err, "full_key", None) or ""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    if isinstance(err, ConfigKeyError) and key:
        section, _, name = key.rpartition(".")
        node = section_of(_hint(section)) if section else Config
        known = sorted(f.name for f in dataclasses.fields(node)) if node else []
        return ConfigError(f"{where}: unknown key {name!r} in {section or 'the top level'}; known: {known}")
    choices = choices_of(_hint(key)) if key else None
    if isinstance(err, ValidationError) and choices:
        return ConfigError(f"{where}: {choice_problem(key, getattr(err, 'value', None), choices)}")
    return ConfigError(f"{where}: {key + ': ' if key else ''}{message}")


def _merge(base, extra: Mapping, where: str):
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(base, normalise(extra))
    except OmegaConfBaseException as err:
        raise _config_error(err, where) from None


def _read_yaml(path: str | os.PathLike) -> dict:
    import yaml
    from omegaconf import DictConfig, OmegaConf

    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{at}: not valid YAML: {problem}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, rollout, ...)")
    return OmegaConf.to_container(loaded, resolve=False)


def _parse_override(item: str) -> dict:
    import yaml
    from omegaconf import OmegaConf

    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {problem}") from None


def _finish(cfg, where: str) -> Config:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _config_error(err, where) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the overrides (each `section.key=value`, the value read as YAML)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config)
    if path is not None:
        cfg = _merge(cfg, _read_yaml(path), str(path))
    for item in overrides or []:
        cfg = _merge(cfg, _parse_override(item), f"override {item!r}")
    return _finish(cfg, str(path) if path else "the configuration")


def build_config(base: Config | None = None, sections: Mapping[str, Any] | None = None) -> Config:
    """`base` (default: the defaults) with `sections` merged over it, e.g. {"run": {"steps": 10}}."""
    from omegaconf import OmegaConf

    cfg = _merge(OmegaConf.structured(base if base is not None else Config), sections or {}, "the sections given")
    return _finish(cfg, "the sections given")
