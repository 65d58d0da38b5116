"""The operator's terminal view: `luftpause status`, `runs`, `cancel` and `approve`.

`status` reads the scheduler's `GET /status` (replicas, held turns by class, in flight against
the limit, the engine's own queue, the run gate's KV pool); `runs` reads the runtime's `GET
/status` (the run tree with states, budgets and pending approvals). Both print tables for a
person, or the document itself with `--json`. `cancel` and `approve` call the runtime's MCP
tools of the same names with the official `mcp` client, so who may act on a run stays the
runtime's one rule (runtime/callers.py): a run another client spawned needs the operator token.

The addresses come from the config (`--config`, default the embedded stack's ports) or
`--scheduler` / `--runtime`. The bearer is `LUFTPAUSE_TOKEN`; towards the runtime,
`LUFTPAUSE_OPERATOR_TOKEN` where it is set (the runtime takes either, and the operator's sees
every run). A service that does not answer, or refuses the token, ends the command with exit
status 1 and one line saying which address and what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from luftpause import config, lifecycle
from luftpause.config import OPERATOR_TOKEN_ENV, TOKEN_ENV

if TYPE_CHECKING:  # httpx is imported when a command runs, so that `luftpause --help` stays fast
    import httpx

TIMEOUT_S = 10.0
ENDED = ("finished", "failed", "cancelled")
TASK_WIDTH = 48


class Unreachable(Exception):
    """A service did not answer as it should; the message says which and what to do."""


def _local(host: str) -> str:
    """Where to reach a service bound to `host` from this machine."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def scheduler_url(args: argparse.Namespace) -> str:
    if args.scheduler:
        return args.scheduler.rstrip("/")
    s = _config(args).scheduler
    return f"http://{_local(s.host)}:{s.status_port}"


def runtime_url(args: argparse.Namespace) -> str:
    if args.runtime:
        return args.runtime.rstrip("/")
    r = _config(args).runtime
    return f"http://{_local(r.host)}:{r.port}"


def _config(args: argparse.Namespace) -> config.Config:
    try:
        return config.load(args.config)
    except config.ConfigError as e:
        raise Unreachable(str(e)) from None


def _bearer(*names: str) -> dict[str, str]:
    from luftpause.bearer import token_from_env

    token = next((t for n in names if (t := token_from_env(name=n))), None)
    return {"authorization": f"Bearer {token}"} if token else {}


def _server_message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text.strip()[:200] or reply.reason_phrase


def fetch(url: str, service: str, start: str, headers: dict[str, str]) -> Any:
    """GET a status document, or `Unreachable` with the address and the fix."""
    import httpx

    try:
        reply = httpx.get(url, headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as e:
        raise Unreachable(
            f"cannot reach the {service} at {url} ({type(e).__name__}: {e or 'no answer'}): "
            f"start it (`luftpause up`, or `{start}`), or point --{service} at where it listens"
        ) from None
    if reply.status_code == 401:
        has = TOKEN_ENV in os.environ or (service == "runtime" and OPERATOR_TOKEN_ENV in os.environ)
        fix = "check its value" if has else f"set {TOKEN_ENV} to the token the stack was started with"
        raise Unreachable(f"the {service} at {url} refused the request ({_server_message(reply)}): {fix}")
    if reply.status_code != 200:
        raise Unreachable(f"the {service} at {url} answered {reply.status_code}: {_server_message(reply)}")
    return reply.json()


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart, as `docker ps` prints them."""
    cells = [list(headers), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _n(value: object) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _replica_state(r: dict[str, Any]) -> str:
    if r.get("ejection", {}).get("ejected_for_s"):
        return "ejected"
    if not r.get("in_service", True):
        return "draining"
    return "healthy" if r.get("healthy") else "unhealthy"


def _kv(r: dict[str, Any]) -> str:
    if r.get("kv_capacity") is None:
        return "unknown"
    unit = "slots" if r.get("gate") == "slots" else "tokens"
    return f"{_n(r.get('held_kv_tokens'))}/{_n(r.get('kv_capacity'))} {unit}"


def render_status(doc: dict[str, Any]) -> str:
    replicas = table(
        [
            "REPLICA",
            "STATE",
            "IN FLIGHT",
            "OURS WAITING",
            "ENGINE RUNNING",
            "ENGINE WAITING",
            "KV HELD",
            "RUNS HELD",
            "GATE",
        ],
        [
            [
                r["name"],
                _replica_state(r),
                f"{r.get('in_flight', 0)}/{r.get('limit', '-')}",
                _n(r.get("waiting_ours")),
                _n(r.get("running")),
                _n(r.get("waiting")),
                _kv(r),
                _n(r.get("held_runs")),
                r.get("gate") or "-",
            ]
            for r in doc.get("replicas", [])
        ],
    )
    held = doc.get("held", {}).get("by_class", {})
    room = doc.get("waiting_for_room", {}).get("by_class", {})
    runs = doc.get("runs", {}).get("by_class", {})
    classes = table(
        ["CLASS", "HELD TURNS", "OLDEST WAIT", "WAITING FOR ROOM", "GENERATING", "PAUSED", "IDLE"],
        [
            [
                name,
                _n(held.get(name, {}).get("count", 0)),
                _seconds(held.get(name, {}).get("oldest_wait_s")),
                _n(room.get(name, {}).get("runs", 0)),
                _n(runs.get(name, {}).get("generating", 0)),
                _n(runs.get(name, {}).get("paused", 0)),
                _n(runs.get(name, {}).get("idle", 0)),
            ]
            for name in sorted({*held, *room, *runs}, key=lambda c: (c != lifecycle.INTERACTIVE, c))
        ],
    )
    lines = [replicas or "no replicas", "", classes]
    dataplanes = doc.get("dataplanes")
    if dataplanes is not None:
        lines += ["", f"dataplanes connected: {len(dataplanes)}"]
    return "\n".join(lines)


def _tokens(run: dict[str, Any]) -> int:
    totals = run.get("subtree") or run
    return int(totals.get("promptTokens", 0)) + int(totals.get("completionTokens", 0))


def _budget(run: dict[str, Any]) -> str:
    budget = run.get("budget")
    if not budget:
        return "-"
    if budget.get("exceeded"):
        return str(budget["exceeded"])
    used, limits = budget.get("used", {}), budget.get("limits", {})
    return ", ".join(f"{k} {_n(int(used.get(k, 0)))}/{_n(int(v))}" for k, v in limits.items())


def _task(text: str | None) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= TASK_WIDTH else line[: TASK_WIDTH - 3] + "..."


def _active(node: dict[str, Any]) -> bool:
    return node["status"] not in ENDED or any(_active(c) for c in node.get("children", []))


def select_runs(doc: dict[str, Any], handle: str | None, every: bool) -> list[dict[str, Any]]:
    """The tree entries to show: the one rooted at `handle`, else every tree with a run still
    going (all of them with `every`)."""
    tree = doc.get("tree", [])
    if handle is None:
        return tree if every else [node for node in tree if _active(node)]
    stack = list(tree)
    while stack:
        node = stack.pop()
        if node["handle"] == handle:
            return [node]
        stack.extend(node.get("children", []))
    return []


def render_runs(nodes: list[dict[str, Any]]) -> str:
    rows: list[list[object]] = []
    pending: list[str] = []
    stack = [(n, 0) for n in reversed(nodes)]
    while stack:
        node, depth = stack.pop()
        rows.append(
            [
                "  " * depth + node["handle"],
                node["status"],
                node.get("serviceClass") or "-",
                node.get("caller") or "-",
                _n(int(node.get("turns", 0))),
                _n(int(node.get("toolCalls", 0))),
                _n(_tokens(node)),
                _budget(node),
                _task(node.get("error") if node["status"] in ("failed", "cancelled") else node.get("task")),
            ]
        )
        approval = node.get("pendingApproval")
        if approval:
            pending.append(
                f"{node['handle']} waits for approval of {approval['tool']} "
                f"{json.dumps(approval['arguments'])}: luftpause approve {node['handle']} [--deny]"
            )
        stack.extend((c, depth + 1) for c in reversed(node.get("children", [])))
    if not rows:
        return "no runs"
    out = table(
        ["HANDLE", "STATUS", "CLASS", "CALLER", "TURNS", "TOOL CALLS", "TOKENS", "BUDGET", "TASK / ERROR"],
        rows,
    )
    return "\n".join([out, *([""] + pending if pending else [])])


def _status(args: argparse.Namespace) -> str:
    url = scheduler_url(args) + "/status"
    doc = fetch(url, "scheduler", "luftpause scheduler", _bearer(TOKEN_ENV))
    return json.dumps(doc, indent=2) if args.json else render_status(doc)


def _runs(args: argparse.Namespace) -> str:
    url = runtime_url(args) + "/status"
    doc = fetch(url, "runtime", "luftpause runtime", _bearer(OPERATOR_TOKEN_ENV, TOKEN_ENV))
    nodes = select_runs(doc, args.handle, args.all)
    if args.handle is not None and not nodes:
        # Ended longer ago than the runtime keeps runs in memory: its archive still answers.
        view = asyncio.run(_call_tool(args, "status", handle=args.handle))["runs"]
        nodes = [{**v, "children": []} for v in view]
    if args.json:
        return json.dumps(nodes, indent=2)
    # A runtime on a shared store that could not read it lists its own runs and says why.
    text = render_runs(nodes)
    return f"{text}\n\n{doc['notListed']}" if doc.get("notListed") else text


async def _call_tool(args: argparse.Namespace, tool: str, **arguments: Any) -> dict[str, Any]:
    """One MCP tool call on the runtime, as the operator where that token is set."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    url = runtime_url(args) + "/mcp"
    http = httpx2.AsyncClient(headers=_bearer(OPERATOR_TOKEN_ENV, TOKEN_ENV), timeout=TIMEOUT_S)
    try:
        async with http, Client(streamable_http_client(url, http_client=http)) as client:
            result = await client.call_tool(tool, arguments)
    except Exception as e:  # the SDK raises its own and httpx2's errors, grouped by anyio
        raise Unreachable(
            f"cannot reach the runtime's MCP at {url} ({_first_cause(e)}): start it (`luftpause up`, "
            f"or `luftpause runtime`), set {TOKEN_ENV} if it needs one, or point --runtime at it"
        ) from None
    if result.is_error:
        message = " ".join(getattr(c, "text", "") for c in result.content) or "the tool failed"
        message = message.removeprefix(f"Error executing tool {tool}: ")
        if "another caller" in message and not os.environ.get(OPERATOR_TOKEN_ENV):
            message += f"; to act on every run, set {OPERATOR_TOKEN_ENV} to the runtime's operator token"
        raise Unreachable(message)
    return dict(result.structured_content or {})


def _first_cause(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _cancel(args: argparse.Namespace) -> str:
    (before,) = asyncio.run(_call_tool(args, "status", handle=args.handle))["runs"]
    run = before if before["status"] in ENDED else asyncio.run(_call_tool(args, "cancel", handle=args.handle))
    if args.json:
        return json.dumps(run, indent=2)
    if before["status"] in ENDED:
        return f"{run['handle']} had already ended ({run['status']}); nothing changed"
    return f"cancelled {run['handle']} and the runs under it"


def _approve(args: argparse.Namespace) -> str:
    run = asyncio.run(_call_tool(args, "approve", handle=args.handle, allow=not args.deny))
    if args.json:
        return json.dumps(run, indent=2)
    return f"{'declined' if args.deny else 'approved'} the tool call {run['handle']} waited on (now {run['status']})"


def run_command(args: argparse.Namespace) -> None:
    """What the CLI calls for each of the four commands."""
    try:
        text = args.render(args)
    except Unreachable as e:
        print(f"luftpause {args.command}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Its reader stopped early (`luftpause status | head -3`): nothing more to say, and no
        # traceback. stdout goes to /dev/null so that the interpreter's own flush at exit is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None


def add_commands(sub: Any) -> None:
    """The four commands on the CLI's subparsers."""

    def common(p: argparse.ArgumentParser, *services: str) -> argparse.ArgumentParser:
        p.add_argument("--config", metavar="FILE", help="the stack's TOML config, for its addresses")
        for service in services:
            p.add_argument(
                f"--{service}", metavar="URL", help=f"the {service}'s address (default from the config)"
            )
        p.add_argument("--json", action="store_true", help="print the service's JSON instead of a table")
        p.set_defaults(func=run_command)
        return p

    p = common(
        sub.add_parser("status", help="replicas, held turns, in flight, the KV pool (the scheduler's view)"),
        "scheduler",
    )
    p.set_defaults(render=_status)
    p = common(
        sub.add_parser("runs", help="the runtime's run tree: states, budgets, pending approvals"), "runtime"
    )
    p.add_argument("handle", nargs="?", metavar="HANDLE", help="one run and the runs under it")
    p.add_argument("--all", action="store_true", help="ended runs too (those the runtime still keeps)")
    p.set_defaults(render=_runs)
    p = common(sub.add_parser("cancel", help="cancel a run and every run under it"), "runtime")
    p.add_argument("handle", metavar="HANDLE")
    p.set_defaults(render=_cancel)
    p = common(sub.add_parser("approve", help="answer a run's tool call that waits for approval"), "runtime")
    p.add_argument("handle", metavar="HANDLE")
    p.add_argument("--deny", action="store_true", help="decline the call instead (the sub-agent is told)")
    p.set_defaults(render=_approve)
