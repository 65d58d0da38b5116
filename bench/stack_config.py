"""A `luftpause.toml` for a stack on loopback, as the benchmarks and the tests write one.

A config is built as tables (`stack`, `replica`), merged with what a caller adds in TOML text of
its own (`merged`: a table given again gains keys, an array of tables gains entries, so that an
extra `[scheduler]` key or `[[replicas]]` entry needs no string surgery), and written with
tomli-w, which quotes every string and path as TOML wants (`write`). The config's meaning is
luftpause/config.py's; this only writes what it reads.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tomli_w

Tables = dict[str, Any]


def replica(name: str, port: int, models: Iterable[str], **fields: Any) -> Tables:
    """One `[[replicas]]` entry: an engine on loopback `port` serving `models`, with `fields`
    (e.g. `metrics="none"`, `kv_tokens=32768`) as the config names them."""
    return {"name": name, "url": f"http://127.0.0.1:{port}", "models": list(models), **fields}


def stack(
    *,
    grpc: int,
    status: int,
    dataplane: int | None = None,
    runtime: int | None = None,
    runtime_dataplane: str | None = None,
    state_dir: Path | None = None,
    tool_server: Tables | None = None,
    replicas: Iterable[Tables] = (),
) -> Tables:
    """The tables of a stack: the scheduler on `grpc`/`status`; a dataplane on `dataplane` that
    asks it; a runtime on `runtime` whose turns go to `runtime_dataplane` (default: that
    dataplane), keeping its state in `state_dir`, with one tool server; and the replicas."""
    tables: Tables = {"scheduler": {"grpc_port": grpc, "status_port": status}}
    if dataplane is not None:
        tables["dataplane"] = {"port": dataplane, "scheduler": f"127.0.0.1:{grpc}"}
    if runtime is not None:
        tables["runtime"] = {
            "port": runtime,
            "dataplane": runtime_dataplane or f"http://127.0.0.1:{dataplane}",
            **({"state_dir": str(state_dir)} if state_dir is not None else {}),
            **({"mcp_servers": [tool_server]} if tool_server is not None else {}),
        }
    if replicas:
        tables["replicas"] = list(replicas)
    return tables


def merged(tables: Tables, *extra: str | Tables) -> Tables:
    """`tables` with each of `extra` (TOML text or tables) merged in: tables merge key by key,
    arrays of tables are extended, any other value is replaced."""
    out = dict(tables)
    for more in extra:
        for key, value in (tomllib.loads(more) if isinstance(more, str) else more).items():
            mine = out.get(key)
            if isinstance(mine, dict) and isinstance(value, dict):
                out[key] = merged(mine, value)
            elif (
                isinstance(mine, list)
                and isinstance(value, list)
                and all(isinstance(v, dict) for v in mine + value)
            ):
                out[key] = mine + value
            else:
                out[key] = value
    return out


def write(directory: Path, tables: Tables, name: str = "luftpause.toml") -> Path:
    """Writes `tables` as `directory/name`; its path."""
    path = directory / name
    path.write_text(tomli_w.dumps(tables))
    return path


def amend(path: Path, *extra: str | Tables) -> Path:
    """Merges `extra` (as `merged` does) into the config file at `path`, in place; its path."""
    return write(path.parent, merged(tomllib.loads(path.read_text()), *extra), path.name)
