"""The backend contract this core implements: a version number a backend may declare it was written for.

A backend class sets `contract = N` (the `VERSION` it was written against); the
registry refuses one written for another version, naming both and where the
changes are written down (CHANGELOG.md, "Backend contract"; the README,
"Writing a backend"). A backend that declares nothing is checked by shape only.
"""

from __future__ import annotations

VERSION = 2

#: version -> what a backend written for it does, in one line (CHANGELOG.md has the detail)
HISTORY = {
    1: "engines built by their own constructor, Engine(model, dtype, device, ...)",
    2: "engines built by Engine.build(model, **options): __init__(args, options) with TrainArgs / RolloutArgs and "
       "a frozen Options dataclass; rollouts carry the token that ended them; seed=None draws from the engine's "
       "own generator",
}

WHERE = ("gearshift's CHANGELOG.md (section 'Backend contract') and its README ('Writing a backend') say what "
         "changed and how to port")


def mismatch(cls: type) -> str | None:
    """Why `cls` cannot be used with this core's contract (None: it can, or it declares no version)."""
    declared = getattr(cls, "contract", None)
    if declared is None or declared == VERSION:
        return None
    then = HISTORY.get(declared, "a version this gearshift does not know")
    return (f"{cls.__module__}.{cls.__name__} was written for backend contract {declared} ({then}); this gearshift "
            f"implements contract {VERSION} ({HISTORY[VERSION]}): {WHERE}")
