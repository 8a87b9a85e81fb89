"""Tools: plain Python functions the model may call mid-episode, named like rewards are.

    tool = load_tool("gearshift.rl.agent.builtin:calc")   # a module
    tool = load_tool("my_tools.py:search")                 # a file
    tool.schema        # {"name": "calc", "description": ..., "parameters": {JSON schema from the signature}}
    tool.call({"expression": "12+7"})   # -> ToolResult("19", error=False)

A call never raises: a tool that raises, times out, or is handed arguments it does not
take answers with an error text the model reads, and the episode goes on.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable

from ..rewards import module_of, public_functions


class ToolError(ValueError):
    """A tool that cannot be loaded (bad name, missing file or function, not callable)."""


#: JSON-schema types of annotations
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class ToolResult:
    text: str
    error: bool = False


def _json_type(annotation: Any) -> dict:
    origin = typing.get_origin(annotation) or annotation
    if origin in _JSON_TYPES:
        return {"type": _JSON_TYPES[origin]}
    return {}  # unannotated or another type: any JSON value


class Tool:
    """A loaded tool: its name, its schema (from the signature and docstring), and a call that never raises."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, *, timeout: float = 5.0) -> None:
        if not callable(fn):
            raise ToolError(f"tool {name or fn!r} is a {type(fn).__name__}, not a function")
        self.fn, self.timeout = fn, timeout
        self.name = name or getattr(fn, "__name__", None) or repr(fn)
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError) as err:
            raise ToolError(f"tool {self.name!r} has no signature to take its arguments from: wrap it in a "
                            f"function with named parameters") from err
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # an annotation that does not resolve: leave the types out
            hints = {}
        properties, required = {}, []
        for p in self.signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            properties[p.name] = _json_type(hints.get(p.name, p.annotation))
            if p.default is p.empty:
                required.append(p.name)
        doc = inspect.getdoc(fn) or ""
        self.parameters = list(properties)
        self.schema = {"name": self.name, "description": doc.split("\n\n")[0].strip(),
                       "parameters": {"type": "object", "properties": properties, "required": required}}

    def call(self, args: list | None = None, kwargs: dict | None = None) -> ToolResult:
        """The tool's answer as text, or an error text: never raises."""
        args, kwargs = list(args or []), dict(kwargs or {})
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as err:
            return ToolResult(f"error: bad arguments for {self.name}: {err}", True)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            value = pool.submit(self.fn, *args, **kwargs).result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            return ToolResult(f"error: {self.name} timed out after {self.timeout:g} s", True)
        except Exception as err:
            return ToolResult(f"error: {self.name} raised {type(err).__name__}: {err}", True)
        finally:
            pool.shutdown(wait=False)  # a call that timed out finishes in its thread; the episode moves on
        return ToolResult("" if value is None else str(value))

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def load_object(spec: str, what: str):
    """The object a 'module:name' or 'path/to/file.py:name' string names (`what` names it in errors)."""
    if not isinstance(spec, str):
        raise ToolError(f"{what} must be a 'module:name' or 'path/to/file.py:name' string, got "
                        f"{type(spec).__name__}")
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ToolError(f"{what} {spec!r} must be 'module:name' or 'path/to/file.py:name'")
    module = module_of(where, spec, what, ToolError)
    if not hasattr(module, name):
        offered = public_functions(module) + sorted(k for k, v in vars(module).items()
                                                    if inspect.isclass(v) and not k.startswith("_"))
        raise ToolError(f"{what} {spec!r}: {where} has no {name!r}; it offers: {', '.join(offered) or 'nothing'}")
    return getattr(module, name)


def load_tool(spec: Any, *, timeout: float = 5.0) -> Tool:
    """A `Tool` from 'module:fn', 'path/to/file.py:fn', a callable or a `Tool`; named after the function."""
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        return Tool(spec, timeout=timeout)
    fn = load_object(spec, "tool")
    if not callable(fn):
        raise ToolError(f"tool {spec!r}: {spec.rpartition(':')[2]} is a {type(fn).__name__}, not a function")
    return Tool(fn, name=spec.rpartition(":")[2], timeout=timeout)


def load_tools(specs, *, timeout: float = 5.0) -> dict[str, Tool]:
    """Tools by name; two of one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, timeout=timeout)
        if tool.name in tools:
            raise ToolError(f"two tools are named {tool.name!r} ({spec!r} and an earlier one): rename one")
        tools[tool.name] = tool
    return tools
