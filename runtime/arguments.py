"""Tool arguments that fail a tool's schema, said in one sentence.

pydantic's own message has a line per error, the error's type and a documentation URL; a
harness model (or the person reading its transcript) needs which argument was wrong and what it
should be: `spawn: serviceClass must be 'interactive' or 'batch', not 'urgent'.`
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def readable_arguments_error(tool: str, error: ValidationError) -> str:
    """One sentence saying which arguments of `tool` were wrong and what each should be."""
    problems = []
    for err in error.errors():
        name = ".".join(str(part) for part in err["loc"]) or "arguments"
        got = err.get("input")
        if err["type"] == "missing":
            problems.append(f"{name} is required")
        elif err["type"] == "literal_error":
            problems.append(f"{name} must be {err['ctx']['expected']}, not {_shown(got)}")
        else:
            message = err["msg"][0].lower() + err["msg"][1:]
            problems.append(f"{name} {message.removeprefix('input ')}, not {_shown(got)}")
    return f"{tool}: " + "; ".join(problems) + "."
