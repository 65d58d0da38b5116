"""The services' code stays readable in pieces: in `scheduler/` and `dataplane/` no module is over
600 lines and no function over 60 (issue 26); something longer is split along its concepts, and
docs/where-things-live.md says where each one went."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return [p for part in ("scheduler", "dataplane") for p in sorted((ROOT / part).rglob("*.py"))]


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """Each function of `source` over MAX_FUNCTION_LINES, from its `def` to its last line: its
    name, first line and length."""
    return [
        (node.name, node.lineno, length)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]


def test_no_module_over_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_60_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for p in _modules()
        for name, line, length in long_functions(p.read_text())
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(long)


def test_a_function_is_measured_from_its_def_to_its_last_line() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"@decorated\ndef f():\n{body}\n") == [("f", 2, MAX_FUNCTION_LINES + 1)]
    sixty = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    assert long_functions(f"class C:\n    async def g(self):\n{sixty}\n") == []
