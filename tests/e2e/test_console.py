"""The operator's terminal view against a real stack (`luftpause up`): `luftpause status`, `runs`,
`approve` and `cancel` as a person at a terminal runs them, with and without `LUFTPAUSE_TOKEN`,
and what they say when a service is not there or refuses them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from support import (
    LoopbackServer,
    Ports,
    QuietHandler,
    call,
    free_port,
    start_up,
    stop_up,
    task_planning,
    wait_until,
    write_config,
)

from luftpause.runtime.run import Run
from luftpause.runtime.spec import RunSpec
from luftpause.runtime.views import status_runs

OPERATOR = "operator-secret"
TOKEN = "stack-secret"


@dataclass
class Stack:
    ports: Ports
    config: Path
    token: str | None

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`luftpause ARGS --config F` with only the variables in `env` of the two tokens."""
        base = {
            k: v for k, v in os.environ.items() if k not in ("LUFTPAUSE_TOKEN", "LUFTPAUSE_OPERATOR_TOKEN")
        }
        command = [sys.executable, "-m", "luftpause", *args, "--config", str(self.config)]
        return subprocess.run(
            command, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60
        )

    def runtime_status(self) -> dict:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.get(f"http://127.0.0.1:{self.ports.runtime}/status", headers=headers, timeout=10).json()

    async def spawn_waiting(self, prefix: str) -> str:
        """A run (of the caller "alice") that waits for approval of its first tool call."""
        headers = {"x-luftpause-caller": "alice"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        http = httpx2.AsyncClient(headers=headers, timeout=30)
        url = f"http://127.0.0.1:{self.ports.runtime}/mcp"
        async with http, Client(streamable_http_client(url, http_client=http)) as client:
            task = task_planning(1, prefix)
            spawned = await call(
                client, "spawn", task=task, tools=["lookup"], approveTools=["lookup"], maxTokens=16
            )
        handle = spawned["handle"]
        wait_until(
            lambda: self.status_of(handle) == "AwaitingApproval", 30, what=f"{handle} to wait for approval"
        )
        return handle

    def status_of(self, handle: str) -> str | None:
        return next((r["status"] for r in self.runtime_status()["runs"] if r["handle"] == handle), None)


def stack(directory: Path, token: str | None) -> Iterator[Stack]:
    ports = Ports()
    config = write_config(directory, ports)
    env = {"LUFTPAUSE_OPERATOR_TOKEN": OPERATOR, "LUFTPAUSE_TOKEN": token or ""}
    proc = start_up(config, directory / "up.log", env=env)
    try:
        yield Stack(ports, config, token)
    finally:
        stop_up(proc)


@pytest.fixture(scope="module")
def open_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """No LUFTPAUSE_TOKEN: anyone reads; only the operator token acts on another caller's run."""
    yield from stack(tmp_path_factory.mktemp("console-open"), None)


@pytest.fixture(scope="module")
def guarded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from stack(tmp_path_factory.mktemp("console-guarded"), TOKEN)


def rows(table: str) -> dict[str, dict[str, str]]:
    """A printed table (up to its first blank line) as {first cell: {header: cell}}; headers are
    words with single spaces, two or more between columns."""
    lines = table.splitlines()
    columns = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
    bounds = [
        (start, end) for (start, _), end in zip(columns, [*(s for s, _ in columns[1:]), None], strict=True)
    ]
    out = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in bounds]
        out[cells[0]] = {name: cell for (_, name), cell in zip(columns, cells, strict=True)}
    return out


def test_status_shows_each_replica_and_each_class(open_stack: Stack) -> None:
    reply = httpx.post(
        f"http://127.0.0.1:{open_stack.ports.dataplane}/v1/chat/completions",
        json={"model": "fake-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-luftpause-run-id": "console-run", "x-luftpause-class": "batch"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text

    def settled() -> tuple[subprocess.CompletedProcess[str], dict] | None:
        """The table between two identical documents: the engines' load readings move the
        replicas' limits for a moment after the turn, so a table is compared with the document
        it was printed from only once nothing moved while it was printed."""
        before = open_stack.cli("status", "--json")
        shown = open_stack.cli("status")
        after = open_stack.cli("status", "--json")
        for done in (before, shown, after):
            assert done.returncode == 0, done.stderr
        doc, again = json.loads(before.stdout), json.loads(after.stdout)
        return (shown, doc) if doc["replicas"] == again["replicas"] else None

    shown, doc = wait_until(settled, 30, interval_s=0.2, what="the scheduler's status to settle")
    replicas = rows(shown.stdout)
    assert set(replicas) == {"fake-a", "fake-b"} == {r["name"] for r in doc["replicas"]}
    for r in doc["replicas"]:
        row = replicas[r["name"]]
        assert row["STATE"] == "healthy"
        assert row["IN FLIGHT"] == f"{r['in_flight']}/{r['limit']}"
        assert row["KV HELD"] == f"{r['held_kv_tokens']:,}/{r['kv_capacity']:,} tokens"
        assert row["RUNS HELD"] == str(r["held_runs"]) and row["GATE"] == "tokens"
    classes = rows(shown.stdout.split("\n\n")[1])
    assert set(classes) == {"interactive", "batch"}
    batch = classes["batch"]
    assert batch["HELD TURNS"] == "0" and batch["OLDEST WAIT"] == "-"
    assert int(batch["GENERATING"]) + int(batch["PAUSED"]) + int(batch["IDLE"]) == 1


async def test_runs_shows_a_pending_approval_and_only_the_operator_answers_it(open_stack: Stack) -> None:
    handle = await open_stack.spawn_waiting("console approve")
    shown = open_stack.cli("runs")
    assert shown.returncode == 0, shown.stderr
    run = rows(shown.stdout)[handle]
    assert run["STATUS"] == "AwaitingApproval" and run["CALLER"] == "mcp/0.1.0@alice"
    assert f"{handle} waits for approval of lookup" in shown.stdout
    assert f"luftpause approve {handle} [--deny]" in shown.stdout
    (as_json,) = json.loads(open_stack.cli("runs", handle, "--json").stdout)
    assert as_json["pendingApproval"]["tool"] == "lookup"

    # The CLI is another caller than alice: without the operator token it may not answer.
    refused = open_stack.cli("approve", handle)
    assert refused.returncode == 1 and refused.stdout == ""
    assert f"run {handle} was spawned by another caller" in refused.stderr
    assert "set LUFTPAUSE_OPERATOR_TOKEN" in refused.stderr
    assert open_stack.status_of(handle) == "AwaitingApproval"

    approved = open_stack.cli("approve", handle, env={"LUFTPAUSE_OPERATOR_TOKEN": OPERATOR})
    assert approved.returncode == 0, approved.stderr
    assert approved.stdout.startswith(f"approved the tool call {handle} waited on")
    wait_until(lambda: open_stack.status_of(handle) == "finished", 60, what=f"{handle} to finish")
    # Ended runs are left out unless asked for.
    assert handle not in rows(open_stack.cli("runs").stdout or "X\n")
    assert rows(open_stack.cli("runs", "--all").stdout)[handle]["STATUS"] == "finished"


async def test_cancel_ends_a_run_and_says_so_the_second_time(open_stack: Stack) -> None:
    handle = await open_stack.spawn_waiting("console cancel")
    as_operator = {"LUFTPAUSE_OPERATOR_TOKEN": OPERATOR}
    cancelled = open_stack.cli("cancel", handle, env=as_operator)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == f"cancelled {handle} and the runs under it"
    assert open_stack.status_of(handle) == "cancelled"
    again = open_stack.cli("cancel", handle, env=as_operator)
    assert again.stdout.strip() == f"{handle} had already ended (cancelled); nothing changed"
    unknown = open_stack.cli("cancel", "no-such-run", env=as_operator)
    assert unknown.returncode == 1 and "no-such-run" in unknown.stderr


async def test_with_a_token_each_command_needs_it(guarded_stack: Stack) -> None:
    handle = await guarded_stack.spawn_waiting("console guarded")
    for command in (["status"], ["runs"]):
        refused = guarded_stack.cli(*command)
        assert refused.returncode == 1 and refused.stdout == ""
        assert "refused the request (missing" in refused.stderr
        assert "set LUFTPAUSE_TOKEN to the token the stack was started with" in refused.stderr
        wrong = guarded_stack.cli(*command, env={"LUFTPAUSE_TOKEN": "wrong"})
        assert wrong.returncode == 1 and "check its value" in wrong.stderr
    token = {"LUFTPAUSE_TOKEN": TOKEN}
    assert guarded_stack.cli("status", env=token).returncode == 0
    assert rows(guarded_stack.cli("runs", env=token).stdout)[handle]["STATUS"] == "AwaitingApproval"
    refused = guarded_stack.cli("cancel", handle)
    assert refused.returncode == 1 and "missing bearer token" in refused.stderr
    # The shared token reads every run but acts only on its own: alice's needs the operator's.
    not_yours = guarded_stack.cli("cancel", handle, env=token)
    assert not_yours.returncode == 1 and "spawned by another caller" in not_yours.stderr
    denied = guarded_stack.cli(
        "approve", handle, "--deny", env={**token, "LUFTPAUSE_OPERATOR_TOKEN": OPERATOR}
    )
    assert denied.returncode == 0, denied.stderr
    assert denied.stdout.startswith(f"declined the tool call {handle} waited on")
    wait_until(lambda: guarded_stack.status_of(handle) in ("finished", "failed"), 60, what=f"{handle} to end")


def test_a_service_that_is_not_there_is_named_with_what_to_start(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "luftpause"]
    for args, service, start in (
        (["status", "--scheduler", down], "scheduler", "luftpause scheduler"),
        (["runs", "--runtime", down], "runtime", "luftpause runtime"),
        (["cancel", "some-run", "--runtime", down], "runtime's MCP", "luftpause runtime"),
    ):
        shown = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 1 and shown.stdout == ""
        (line,) = shown.stderr.splitlines()
        assert line.startswith(f"luftpause {args[0]}: cannot reach the {service} at {down}/"), line
        assert f"`{start}`" in line and "point --" in line


@contextlib.contextmanager
def _runtime_listing(runs: list[Run], not_listed: str | None) -> Iterator[str]:
    """The URL of a stand-in runtime whose GET /status lists `runs` and says `not_listed`."""
    listed, tree = status_runs(runs)
    body = json.dumps({"runs": listed, "tree": tree, "notListed": not_listed}).encode()

    class Status(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.answer(200, body, {"content-type": "application/json"})

    server = LoopbackServer(Status)
    try:
        yield server.url
    finally:
        server.close()


def _run(handle: str, task: str = "t") -> Run:
    return Run(handle=handle, spec=RunSpec(task=task, model="m"), caller="alice", created_at=0.0, messages=[])


def test_runs_says_which_runs_a_runtime_could_not_list(tmp_path: Path) -> None:
    # A runtime on a shared store whose database is down lists its own runs and says why not the others'.
    missing = "the runs other runtimes drive are not listed: the run store ... cannot be reached"
    with _runtime_listing([_run("run-here", "summarise the report")], missing) as url:
        shown = subprocess.run([sys.executable, "-m", "luftpause", "runs", "--runtime", url],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        as_json = subprocess.run([sys.executable, "-m", "luftpause", "runs", "--runtime", url, "--json"],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    table, note = shown.stdout.rstrip("\n").split("\n\n")
    assert "run-here" in table and "summarise the report" in table
    assert note == missing
    assert [n["handle"] for n in json.loads(as_json.stdout)] == ["run-here"], "--json stays the runs alone"


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    # `luftpause runs | head -1`, with the reader gone before anything is written: a stand-in
    # runtime answers a long list, and the pipe's read end is closed at once.
    with _runtime_listing([_run(f"run-{i:04d}") for i in range(2000)], None) as url:
        proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "runs", "--all", "--runtime", url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 0
