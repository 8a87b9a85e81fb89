"""The construction contract: the arguments every engine receives, and each engine's own options.

Every engine is built the same way, by `build` (or `gearshift.create`, which
finds the class by name first):

    engine = MyEngine.build("path/to/model", lr=1e-5, my_option=3)
    engine = gearshift.create("train", "mine", model="path/to/model", lr=1e-5, my_option=3)

`build` splits the keywords into the common arguments of the engine's kind
(`TrainArgs`, `RolloutArgs`: typed dataclasses declared by the core) and the
engine's own `Options` (a dataclass nested in the engine class), checks names
and types, joins the process group (`gearshift.dist.init`), calls
`MyEngine(args, options)`, and checks the attributes every engine must set
(`device`, `mesh`, and for rollout engines `max_model_len`). An unknown keyword
or a value of the wrong type fails before anything is built, listing the valid
options. `gearshift backends NAME` prints them with their types and defaults.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from . import dist as gdist
from .mesh import MeshError, MeshSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class OptionError(ValueError):
    """An engine option that does not exist or has a value of the wrong type."""


class EngineError(RuntimeError):
    """An engine that breaks the construction contract (a missing attribute, a malformed `Options`)."""


def option(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """A dataclass field with a default, a one-line help text, and optionally the values it takes."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if isinstance(default, (dict, list, set)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch dtype) -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise OptionError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: str | torch.dtype) -> str:
    return str(parse_dtype(dtype)).removeprefix("torch.")


@dataclass(frozen=True)
class EngineArgs:
    """What every engine, of either kind, is built from."""

    model: str = field(metadata={"help": "a local Hugging Face model folder (config, weights, tokenizer)"})
    mesh: MeshSpec | None = option(None, "how the engine lies over the ranks, e.g. 'dp=2' or 'tp=2'; "
                                         "None: data parallel over every rank")
    dtype: str = option("float32", "dtype of the weights the engine holds", choices=tuple(DTYPES))
    seed: int = option(0, "seed of the engine's random generators")

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if isinstance(self.mesh, str):
            try:
                object.__setattr__(self, "mesh", MeshSpec.parse(self.mesh) if self.mesh else None)
            except MeshError as err:
                raise OptionError(f"mesh: {err}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def resolved_mesh(self) -> MeshSpec:
        """`mesh`, or data parallel over the world; checked against the world size."""
        world = gdist.world_size()
        return (self.mesh or MeshSpec(dp=world)).validate(world)


@dataclass(frozen=True)
class NoOptions:
    """An engine with no options of its own."""


class Buildable:
    """What `TrainEngine` and `RolloutEngine` share: typed construction through `build`.

    A subclass declares its own options as a nested dataclass `Options` (every
    field with a default, made with `option(default, help)`) and implements
    `__init__(self, args, options)`.
    """

    #: the common arguments of the engine's kind (set by `TrainEngine` / `RolloutEngine`)
    Args: ClassVar[type] = EngineArgs
    #: the engine's own options
    Options: ClassVar[type] = NoOptions
    #: attributes a built engine must have set: name -> what it must be
    required_attributes: ClassVar[dict[str, str]] = {}
    #: distributions the engine needs ("a|b" accepts either), and how to install them
    requires: ClassVar[tuple[str, ...]] = ()
    install: ClassVar[str] = ""
    #: known contract failures where it runs: {"train"|"rollout"|"pair": {test name: reason}}
    conformance_xfail: ClassVar[dict[str, dict[str, str]]] = {}
    #: the backend contract the engine was written for (`gearshift.contract.VERSION` then); None: undeclared
    contract: ClassVar[int | None] = None

    def __init__(self, args: EngineArgs, options: Any = None) -> None:
        self.args = args
        self.options = options if options is not None else self.Options()
        self.mesh = args.resolved_mesh()

    @classmethod
    def build(cls, model: str, /, **kwargs: Any):
        """Check `kwargs` against the common arguments and `Options`, join the process group, build, check."""
        args, options = parse_options(cls, {"model": model, **kwargs})
        gdist.init()
        engine = cls(args, options)
        check_built(engine)
        return engine


def _fields(datacls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(datacls)}


def check_engine_class(cls: type) -> None:
    """Raise `EngineError` unless `cls` was written for this contract and declares its options as `build` needs."""
    from . import contract

    why = contract.mismatch(cls)
    if why:
        raise EngineError(why)
    options = getattr(cls, "Options", NoOptions)
    if not dataclasses.is_dataclass(options):
        raise EngineError(f"{cls.__name__}.Options must be a dataclass, got {options!r}")
    common = _fields(cls.Args)
    for name, f in _fields(options).items():
        if name in common:
            raise EngineError(f"{cls.__name__}.Options.{name} shadows the common argument {name!r} "
                              f"of every {cls.Args.__name__}: rename it")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise EngineError(f"{cls.__name__}.Options.{name} has no default: every engine option needs one")
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise EngineError(f"{cls.__name__}.__init__ must take (args, options); it takes "
                          f"({', '.join(p.name for p in params)}), the shape of backend contract 1, before "
                          f"contract {contract.VERSION}: {contract.WHERE}")


def parse_options(cls: type, kwargs: dict[str, Any]) -> tuple[EngineArgs, Any]:
    """Split `kwargs` into `cls.Args` and `cls.Options`, checking every name and type."""
    check_engine_class(cls)
    common, own = _fields(cls.Args), _fields(cls.Options)
    _no_unknown(cls, kwargs)
    return (_make(cls.Args, {k: v for k, v in kwargs.items() if k in common}, cls.__name__),
            _make(cls.Options, {k: v for k, v in kwargs.items() if k in own}, cls.__name__))


def positive_int(text: str) -> int:
    """A count on a command line that must be at least 1 (prompts, samples, steps): an argparse type."""
    return _int_at_least(text, 1)


def count(text: str) -> int:
    """A count on a command line that may be 0 (switches left out, steps skipped): an argparse type."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is less than {least}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """Engine options written on a command line as a JSON object (`--options '{"hf": {"max_batch_size": 8}}'`):
    an argparse type, so a malformed one is an error naming its flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err}); write an object: "
                                         f"'{{\"name\": value}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; write one: '{{\"name\": value}}'")
    return value


def check_options(cls: type, options: dict[str, Any]) -> None:
    """Raise `OptionError` unless every one of `options` is an option of engine class `cls` (its own, or an
    argument every engine of its kind takes) with a value of its type: what `build` would check, before it."""
    check_engine_class(cls)
    _no_unknown(cls, options)
    own = _fields(cls.Options)
    _make(cls.Options, {k: v for k, v in options.items() if k in own}, cls.__name__)


def _no_unknown(cls: type, kwargs: dict[str, Any]) -> None:
    common, own = _fields(cls.Args), _fields(cls.Options)
    unknown = sorted(set(kwargs) - set(common) - set(own))
    if unknown:
        # `{name:value}` in an override is YAML's one key 'name:value' (a mapping needs a space after the colon)
        glued = [k for k in unknown if isinstance(k, str) and ":" in k and kwargs[k] is None
                 and k.split(":", 1)[0].strip() in {**common, **own}]
        hint = f" ({glued[0]!r} reads as one name: write a space after the colon, {{name: value}})" if glued else ""
        raise OptionError(
            f"{cls.__name__} has no option {', '.join(map(repr, unknown))}{hint}. Every "
            f"{cls.Args.__name__[:-4].lower()} engine takes: {', '.join(common)}; {cls.__name__} also takes: "
            f"{', '.join(own) or 'nothing else'} (see 'gearshift backends NAME')")


def _make(datacls: type, values: dict[str, Any], owner: str):
    hints = typing.get_type_hints(datacls)
    fields_ = _fields(datacls)
    checked = {}
    for name, value in values.items():
        checked[name] = coerce(value, hints.get(name, Any), f"{owner} option {name!r}")
        choices = fields_[name].metadata.get("choices")
        if choices is not None and checked[name] is not None and checked[name] not in choices:
            raise OptionError(f"{owner} option {name!r} = {value!r}: use one of {list(choices)}")
    try:
        return datacls(**checked)
    except TypeError as err:  # a required field left out
        raise OptionError(f"{owner}: {err}") from None


def coerce(value: Any, kind: Any, what: str) -> Any:
    """`value` as type `kind` (ints widen to floats, numeric strings are read); else `OptionError`."""
    if kind is Any or kind is object:
        return value
    origin, params = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in params:
            return None
        errors = []
        for option_type in (p for p in params if p is not type(None)):
            try:
                return coerce(value, option_type, what)
            except OptionError as err:
                errors.append(err)
        if len(errors) == 1:  # `X | None`: what X said is the most precise
            raise errors[0]
        raise OptionError(f"{what} = {value!r}: expected {_type_name(kind)}")
    if origin is typing.Literal:
        if value in params:
            return value
        raise OptionError(f"{what} = {value!r}: use one of {list(params)}")
    if kind is MeshSpec:
        if isinstance(value, MeshSpec):
            return value
        if isinstance(value, str):
            try:
                return MeshSpec.parse(value)
            except MeshError as err:
                raise OptionError(f"{what}: {err}") from None
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, torch.dtype):
            return dtype_name(value)
    elif origin in (list, tuple, typing.Sequence) or kind in (list, tuple):
        if isinstance(value, (list, tuple)):
            return type(value)(value) if origin is None else (list(value) if origin is list else tuple(value))
    elif origin is dict or kind is dict:
        if isinstance(value, dict):
            return dict(value)
    elif isinstance(kind, type) and isinstance(value, kind):
        return value
    raise OptionError(f"{what} = {value!r} ({type(value).__name__}): expected {_type_name(kind)}")


def _type_name(kind: Any) -> str:
    origin, params = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(p) for p in params)
    if origin is typing.Literal:
        return " | ".join(repr(p) for p in params)
    if kind is type(None):
        return "None"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(p) for p in params)}]"
    return getattr(kind, "__name__", str(kind))


def describe(cls: type) -> list[tuple[str, str, str, str, str]]:
    """(where, name, type, default, help) for every option `cls.build` takes: common ones first."""
    rows = []
    for where, datacls in (("common", cls.Args), ("own", getattr(cls, "Options", NoOptions))):
        hints = typing.get_type_hints(datacls)
        for f in dataclasses.fields(datacls):
            if f.default is not dataclasses.MISSING:
                default = repr(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = repr(f.default_factory())
            else:
                default = "(required)"
            help_ = f.metadata.get("help", "")
            if "choices" in f.metadata:
                help_ += f" [{' | '.join(map(str, f.metadata['choices']))}]"
            rows.append((where, f.name, _type_name(hints.get(f.name, Any)), default, help_))
    return rows


def check_built(engine: Any, name: str | None = None) -> None:
    """Raise `EngineError` naming the backend unless `engine` set the attributes every engine must have."""
    cls = type(engine)
    label = f"backend {name!r} ({cls.__module__}.{cls.__name__})" if name else f"{cls.__module__}.{cls.__name__}"
    problems = []
    device = getattr(engine, "device", None)
    if not isinstance(device, torch.device):
        problems.append(f"device must be a torch.device, got {device!r}")
    mesh = getattr(engine, "mesh", None)
    if not isinstance(mesh, MeshSpec):
        problems.append(f"mesh must be a gearshift.MeshSpec, got {mesh!r}")
    elif mesh.world_size != gdist.world_size():
        problems.append(f"mesh {mesh} spans {mesh.world_size} ranks but the world has {gdist.world_size()}")
    for attr, what in cls.required_attributes.items():
        if attr in ("device", "mesh"):
            continue
        value = getattr(engine, attr, None)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            problems.append(f"{attr} must be {what}, got {value!r}")
    if problems:
        raise EngineError(f"{label} was built without what every engine must set: " + "; ".join(problems))
