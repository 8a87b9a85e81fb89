"""How a model writes a tool call and reads its answer.

`TextFormat`, for any model: `<tool>name(arg, key=value)</tool>` (Python literals as arguments), or
`<name>argument</name>` for a tool of one parameter (the text between the tags is the argument); the
answer comes back as `<result>text</result>`. A turn ends at a closing tag, so the engine stops there.

`ChatFormat`, for a tokenizer whose chat template renders tools: the JSON calls of that template,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Hermes and the many templates that
follow them); the turn ends at the model's end token, and the answer is the template's own rendering of
a `tool` message, up to the next assistant turn's opening.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .tools import Tool, ToolResult


@dataclass
class Call:
    """A tool call parsed from a model's turn; `error` says what was wrong with it (then it is not run)."""

    name: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    error: str | None = None


class ToolFormat:
    """A way of writing tool calls: the strings ending a calling turn, the parse, the answer's text."""

    name = ""

    def __init__(self, tools: dict[str, Tool]) -> None:
        self.tools = tools

    def stops(self) -> list[str]:
        """Strings that end a turn holding a call (the engine stops at them)."""
        return []

    def parse(self, text: str) -> Call | None:
        """The last call in a turn's text; None when the turn calls nothing."""
        raise NotImplementedError

    def observation(self, result: ToolResult, call: Call, turn_text: str) -> str:
        """The text appended after the calling turn: the tool's answer, and what opens the model's next turn."""
        raise NotImplementedError

    def run(self, call: Call) -> ToolResult:
        """The call's answer: the tool's, or an error text for an unknown tool or malformed arguments."""
        if call.error:
            return ToolResult(f"error: {call.error}", True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools) or 'none'}", True)
        return tool.call(call.args, call.kwargs)


class TextFormat(ToolFormat):
    name = "text"

    def __init__(self, tools: dict[str, Tool]) -> None:
        super().__init__(tools)
        # a tool of one parameter may be called by its own tag: <calc>12+7</calc>
        self.tagged = [n for n, t in tools.items() if len(t.parameters) == 1 and n != "tool"]
        names = "|".join(re.escape(n) for n in ["tool", *self.tagged])
        self._pattern = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)

    def stops(self) -> list[str]:
        return ["</tool>"] + [f"</{n}>" for n in self.tagged]

    def parse(self, text: str) -> Call | None:
        found = list(self._pattern.finditer(text))
        if not found:
            return None
        tag, inner = found[-1].group(1), found[-1].group(2)
        if tag != "tool":
            return Call(tag, [inner.strip()])
        return parse_python_call(inner.strip())

    def observation(self, result: ToolResult, call: Call, turn_text: str) -> str:
        return f"<result>{result.text}</result>"


def parse_python_call(text: str) -> Call:
    """`name(1, "a", key=[2])` as a `Call`; only literals are taken as arguments."""
    head = text.split("(", 1)[0].strip() or text
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return Call(head, error=f"cannot read the call {text!r}: write name(arg, key=value)")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return Call(head, error=f"cannot read the call {text!r}: write name(arg, key=value)")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return Call(node.func.id, error=f"the arguments of {text!r} must be literals (numbers, strings, lists)")
    if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
        return Call(node.func.id, error=f"the call {text!r} unpacks arguments; name each one")
    return Call(node.func.id, args, kwargs)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatFormat(ToolFormat):
    name = "chat"

    def __init__(self, tools: dict[str, Tool], tokenizer) -> None:
        super().__init__(tools)
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\x00"}]
        rendered = tokenizer.apply_chat_template(base, tokenize=False)
        #: what the template writes after an assistant's content (its end of turn)
        self.turn_end = rendered[rendered.rindex("\x00") + 1:]
        self._base = rendered

    def parse(self, text: str) -> Call | None:
        found = _TOOL_CALL.findall(text)
        if not found:
            return None
        try:
            value = json.loads(found[-1])
        except json.JSONDecodeError as err:
            return Call("?", error=f"the tool call is not JSON ({err.msg}): write "
                                   f'{{"name": ..., "arguments": {{...}}}}')
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return Call("?", error='a tool call is {"name": ..., "arguments": {...}}')
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return Call(value["name"], error="the arguments are not a JSON object")
        if not isinstance(arguments, dict):
            return Call(value["name"], error="the arguments are not a JSON object")
        return Call(value["name"], [], arguments)

    def observation(self, result: ToolResult, call: Call, turn_text: str) -> str:
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\x00"},
                    {"role": "tool", "name": call.name, "content": result.text}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not rendered.startswith(self._base):
            raise ValueError("the chat template renders a conversation differently once a tool message follows; "
                             "use agent.format=text")
        # the model's turn may have ended before the template's end of turn did (its end token, no newline)
        have = next((k for k in range(len(self.turn_end), 0, -1) if turn_text.endswith(self.turn_end[:k])), 0)
        return self.turn_end[have:] + rendered[len(self._base):]


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tool schemas and tool messages."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    return "tools" in template and "tool" in template.replace("tools", "")


def make_format(name: str, tools: dict[str, Tool], tokenizer) -> ToolFormat:
    """The format `agent.format` names (`auto`: the chat template's where it renders tools, else text)."""
    if name == "auto":
        name = "chat" if tools and template_renders_tools(tokenizer) else "text"
    if name == "chat":
        if not template_renders_tools(tokenizer):
            raise ValueError("agent.format=chat: the tokenizer's chat template does not render tools; use "
                             "agent.format=text (or auto)")
        return ChatFormat(tools, tokenizer)
    if name == "text":
        return TextFormat(tools)
    raise ValueError(f"agent.format={name!r}: use auto, text or chat")


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The tools as a chat template takes them (`apply_chat_template(..., tools=...)`)."""
    return [{"type": "function", "function": t.schema} for t in tools.values()]
