"""The decision core is pure in what it loads, not only in its own text: imported in a fresh
interpreter, `luftpause.scheduler.core` brings in no I/O, clock, randomness, threads or pydantic,
and none of the luftpause modules it loads imports one. (The process around it, main.py and host.py, loads
all of those: the same check flags it, so the check can fail.)"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

# Modules whose loading means I/O, a clock, randomness, threads or validation crept in.
FORBIDDEN_LOADS = (
    "asyncio", "datetime", "grpc", "http", "logging", "pydantic", "random", "selectors", "socket",
    "ssl", "subprocess", "threading", "urllib", "uuid",
)  # fmt: skip
# Modules an interpreter has loaded before any import of ours (so that only an import statement
# in our own modules can show their use).
FORBIDDEN_IMPORTS = ("io", "os", "time", "sys", *FORBIDDEN_LOADS)

PROBE = """
import json, sys
before = set(sys.modules)
import {module}
loaded = sorted(set(sys.modules) - before)
files = {{m: getattr(sys.modules[m], "__file__", None) for m in loaded if m.startswith("luftpause")}}
print(json.dumps({{"loaded": loaded, "files": files}}))
"""


def what_loading_brings(module: str) -> tuple[list[str], dict[str, str]]:
    """(the modules importing `module` loads in a fresh interpreter, luftpause's files among them)."""
    out = subprocess.run(
        [sys.executable, "-I", "-c", PROBE.format(module=module)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    return found["loaded"], found["files"]


def impurities(module: str) -> list[str]:
    """Everything that makes `module` impure: a forbidden module loaded, or imported by one of ours."""
    loaded, files = what_loading_brings(module)
    found = [m for m in loaded if m.split(".")[0] in FORBIDDEN_LOADS]
    for name, path in files.items():
        if path is None:
            continue
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            found += [f"{name} imports {r}" for r in roots if r in FORBIDDEN_IMPORTS]
    return found


def test_the_core_loads_nothing_impure() -> None:
    assert impurities("luftpause.scheduler.core") == []
    loaded, _ = what_loading_brings("luftpause.scheduler.core")
    assert len(loaded) < 60, loaded  # 38 on 2026-12-04, 170 when it went through the config


def test_importing_the_core_loads_every_module_of_its_package() -> None:
    # So that the check above reads each of them: a module the package's __init__ stopped
    # loading would escape it.
    _, files = what_loading_brings("luftpause.scheduler.core")
    package = Path(files["luftpause.scheduler.core"]).parent
    modules = {f"luftpause.scheduler.core.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    assert len(modules) > 5 and modules <= set(files), sorted(modules - set(files))


def test_the_check_flags_the_process_around_the_core() -> None:
    found = impurities("luftpause.scheduler.main")
    for expected in ("grpc", "threading", "pydantic", "socket"):
        assert expected in found, found
    assert (
        "luftpause.scheduler.main imports asyncio" in found
        and "luftpause.scheduler.host imports grpc" in found
    )
