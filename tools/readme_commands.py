#!/usr/bin/env python3
"""The commands README.md tells people to run, as written there.

    python3 tools/readme_commands.py fresh     the two commands for a fresh machine, one a line (.ci/run runs them)
    python3 tools/readme_commands.py all       every command: indented blocks and inline `gearshift ...` spans

A command is a line of an indented (4-space) block outside fenced code, joined over trailing backslashes
and without its trailing comment, or an inline code span that starts like a command (`gearshift train ...`,
`python tools/...`, `bash tools/...`, `pip install ...`, `torchrun ...`). tests/test_readme.py checks that a
test or CI runs each one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FRESH = "## Two commands for a fresh machine"
SUBCOMMANDS = ("train", "backends", "env", "bench", "conformance")
INLINE = re.compile(r"`((?:gearshift (?:%s)|python3? (?:-m |tools/)|bash tools/|pip install |torchrun |tools/\S+\.sh)"
                    r"[^`]*)`" % "|".join(SUBCOMMANDS))


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def block_commands(text: str) -> list[tuple[str, str]]:
    """(section heading, command) of every indented block line outside fenced code."""
    out, section, fenced, pending = [], "", False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            section = line.strip()
        if line.startswith("    ") and line.strip() and (pending or not line.lstrip().startswith("-")):
            part = _strip_comment(line)
            if part.endswith("\\"):
                pending += part[:-1].strip() + " "
                continue
            out.append((section, (pending + part).strip()))
            pending = ""
    return out


def inline_commands(text: str) -> list[str]:
    fenced, found = False, []
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            found += [m.strip() for m in INLINE.findall(line)]
    return found


def fresh(text: str) -> list[str]:
    return [cmd for section, cmd in block_commands(text) if section == FRESH]


def all_commands(text: str) -> list[str]:
    seen: dict[str, None] = {}
    for cmd in [c for _, c in block_commands(text)] + inline_commands(text):
        seen.setdefault(cmd)
    return list(seen)


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    text = README.read_text()
    if what not in ("fresh", "all"):
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(fresh(text) if what == "fresh" else all_commands(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
