"""The `luftpause` command: one subcommand per service, and `up` for the whole stack.

Each service subcommand runs one process in the foreground; `luftpause up` runs them all as
child processes (see `luftpause.up`). Service modules are imported only when their subcommand
runs, so `luftpause --help` stays fast and a broken optional piece cannot stop the others.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pydantic import ValidationError

from luftpause import __version__, config, console, lifecycle, lifeline, logs


def _load_config(args: argparse.Namespace) -> config.Config:
    try:
        conf = config.load(args.config)
    except config.ConfigError as e:
        print(f"luftpause: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # The config's [logging] format, where neither --log-format nor the environment chose one.
    if not args.log_format_given and conf.logging.format != os.environ.get(logs.FORMAT_ENV):
        logs.configure(args.log_level, conf.logging.format, service_name(args.command))
    return conf


def service_name(command: str) -> str:
    """What a command's log lines (and spans) name their service: luftpause-dataplane."""
    return f"luftpause-{command}"


def _scheduler(args: argparse.Namespace) -> None:
    from luftpause.scheduler.main import serve

    serve(_load_config(args))


def _workers(text: str) -> int:
    """--workers, held to the bounds of `[dataplane] workers` (the config says them, once)."""
    try:
        return config.DataplaneSettings.model_validate({"workers": text}).workers
    except ValidationError as e:
        raise argparse.ArgumentTypeError(e.errors()[0]["msg"].lower()) from None


def _dataplane(args: argparse.Namespace) -> None:
    from luftpause.dataplane import workers
    from luftpause.dataplane.app import serve

    conf = _load_config(args)
    if args.workers is not None:
        conf = conf.model_copy(
            update={"dataplane": conf.dataplane.model_copy(update={"workers": args.workers})}
        )
    if args.worker is not None:
        serve(conf, worker=args.worker, listen_fd=args.listen_fd)
    elif conf.dataplane.workers > 1:
        workers.serve_workers(conf, workers.worker_argv(args.config, args.log_level))
    else:
        serve(conf)


def _runtime(args: argparse.Namespace) -> None:
    from luftpause.runtime.server import serve

    serve(_load_config(args), state_dir=args.state_dir)


def _fake_engine(args: argparse.Namespace) -> None:
    from luftpause.fake_engine.server import serve

    serve(
        name=args.name,
        host=args.host,
        port=args.port,
        model=args.model,
        slots=args.slots,
        metrics_flavour=args.metrics,
        time_scale=args.time_scale,
        chunk_tokens=args.chunk_tokens,
    )


def _fake_mcp(args: argparse.Namespace) -> None:
    from luftpause.fake_mcp.server import serve, serve_stdio

    if args.stdio:
        serve_stdio(fixed_latency_s=args.fixed_latency_s)
    else:
        serve(host=args.host, port=args.port, fixed_latency_s=args.fixed_latency_s)


def _up(args: argparse.Namespace) -> None:
    from luftpause.up import up

    with_fakes = True if args.with_fakes else None
    if args.config:
        _load_config(args)  # its [logging] format is up's, and so its services'
    raise SystemExit(
        up(config_path=args.config, state_dir=args.state_dir, with_fakes=with_fakes, log_level=args.log_level)
    )


def _loadgen(args: argparse.Namespace) -> None:
    import asyncio
    import json

    if args.spawn is not None or args.spawn_agents is not None:
        from luftpause.loadgen import subagents

        if args.spawn is not None:
            summary = subagents.fan_out(
                args.runtime, args.spawn, args.context_chars, args.service_class, args.seed
            )
        else:
            summary = subagents.flood(
                subagents.FloodSpec(
                    url=args.runtime,
                    agents=args.spawn_agents,
                    duration_s=args.duration_s,
                    service_class=args.service_class,
                    context_chars=args.context_chars,
                    seed=args.seed,
                    warmup_s=args.warmup_s,
                )
            )
        # The MCP client's own per-request lines would break the progress line (the HTTP clients'
        # are held back already, luftpause/logs.py).
        logging.getLogger("mcp").setLevel(max(logging.WARNING, logging.getLogger().level))
        print(json.dumps(asyncio.run(summary)))
        return

    from luftpause.loadgen.agents import LoadSpec, run_load

    spec = LoadSpec(
        url=args.url,
        agents=args.agents,
        duration_s=args.duration_s,
        service_class=args.service_class,
        caller=args.caller,
        context_chars=args.context_chars,
        tool_latency_s=args.tool_latency_s,
        model=args.model,
        stream=args.stream,
        seed=args.seed,
        warmup_s=args.warmup_s,
    )
    print(json.dumps(asyncio.run(run_load(spec))))


# Benchmarks whose module is not `luftpause.bench.<name>`.
BENCH_MODULES = {"fidelity": "sim.fidelity", "frontier": "sim.frontier"}


def _bench(args: argparse.Namespace) -> None:
    import importlib

    module = importlib.import_module(f"luftpause.bench.{BENCH_MODULES.get(args.scenario, args.scenario)}")
    raise SystemExit(module.main(args.rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="luftpause",
        description="Run-aware scheduling between agent harnesses and LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"luftpause {__version__}")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=logs.LEVELS,
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR (default INFO); below DEBUG, HTTP client lines are left out",
    )
    parser.add_argument(
        "--log-format",
        type=str.lower,
        choices=logs.FORMATS,
        default=None,
        help=f"text (the default) or json, one object a line with trace ids (also {logs.FORMAT_ENV}, "
        "[logging] format); passed on to the services up starts",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", metavar="FILE", help="TOML config file (default: the embedded stack)")
        return p

    p = with_config(
        sub.add_parser("up", help="start the whole stack on this machine (fake engines by default)")
    )
    p.add_argument(
        "--state-dir", default=None, help="where the runtime keeps runs.jsonl (default from config)"
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=logs.LEVELS,
        default=argparse.SUPPRESS,
        help="as before the command: the level of up and of every service it starts",
    )
    p.add_argument(
        "--with-fakes",
        action="store_true",
        help="with --config: also start a fake engine per loopback replica and a fake MCP server per loopback tool server",
    )
    p.set_defaults(func=_up)

    with_config(sub.add_parser("scheduler", help="the scheduler: gRPC on 5000, status on 5001")).set_defaults(
        func=_scheduler
    )
    p = with_config(sub.add_parser("dataplane", help="the OpenAI-compatible proxy on 8080"))
    p.add_argument(
        "--workers",
        type=_workers,
        default=None,
        metavar="N",
        help="dataplane processes sharing the port (default: [dataplane] workers, 1)",
    )
    # How a multi-worker dataplane starts each worker (dataplane/workers.py); not for users.
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_dataplane)
    p = with_config(sub.add_parser("runtime", help="the MCP server with spawn / await on 7000"))
    p.add_argument("--state-dir", default=None, help="where runs.jsonl lives (default from config)")
    p.set_defaults(func=_runtime)

    p = sub.add_parser("fake-engine", help="a simulated OpenAI-compatible engine")
    p.add_argument("--name", default="fake-a", help="replica name, returned as system_fingerprint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=config.FAKE_ENGINE_PORTS[0])
    p.add_argument("--model", default=config.DEFAULT_MODEL)
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="requests decoded at once, more wait in its queue (default: as many as its KV pool holds)",
    )
    p.add_argument(
        "--metrics", choices=["sglang", "vllm"], default="sglang", help="/metrics names to imitate"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every modelled duration (0.1: ten times faster)",
    )
    p.add_argument("--chunk-tokens", type=int, default=1, help="tokens per streamed chunk (default 1)")
    p.set_defaults(func=_fake_engine)

    p = sub.add_parser("fake-mcp", help="a fake MCP tool server (lookup, deep_search)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=config.FAKE_MCP_PORT)
    p.add_argument("--stdio", action="store_true", help="serve MCP over stdin/stdout instead of HTTP")
    p.add_argument(
        "--fixed-latency-s",
        type=float,
        default=None,
        help="every tool call takes exactly this long (benchmarks use 2); default about a second, random",
    )
    p.set_defaults(func=_fake_mcp)
    p = sub.add_parser(
        "loadgen",
        help="closed-loop own-loop agents through the proxy, or sub-agents over MCP; prints a JSON summary",
    )
    p.add_argument("--url", default=f"http://127.0.0.1:{config.DATAPLANE_PORT}", help="the dataplane")
    p.add_argument(
        "--runtime",
        default=f"http://127.0.0.1:{config.RUNTIME_PORT}/mcp",
        help="the runtime's MCP URL, for --spawn and --spawn-agents",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--agents", type=int, default=8, help="own-loop agents running at once (default 8)")
    mode.add_argument(
        "--spawn", type=int, metavar="N", help="fan N sub-agents out over MCP at once and await them all"
    )
    mode.add_argument(
        "--spawn-agents",
        type=int,
        metavar="N",
        help="N closed-loop agents over MCP, each spawning a sub-agent, awaiting it, spawning the next",
    )
    p.add_argument("--duration-s", type=float, default=60.0, help="how long to count (default 60)")
    p.add_argument("--warmup-s", type=float, default=0.0, help="run this long first without counting")
    p.add_argument("--class", dest="service_class", choices=lifecycle.CLASSES, default=lifecycle.INTERACTIVE)
    p.add_argument("--caller", default="loadgen", help="x-luftpause-caller of every turn")
    p.add_argument("--context-chars", type=int, default=8000, help="size of each run's context")
    p.add_argument("--tool-latency-s", type=float, default=2.0, help="how long each tool call takes")
    p.add_argument("--model", default=config.DEFAULT_MODEL)
    p.add_argument("--stream", action="store_true", help="stream each turn (default: plain JSON)")
    p.add_argument("--seed", default="", help="varies the runs' contexts between loadgen processes")
    p.set_defaults(func=_loadgen)

    console.add_commands(sub)

    p = sub.add_parser("bench", help="run a benchmark from bench/ (see docs/measuring.md)")
    p.add_argument(
        "scenario",
        choices=[
            "fanout",
            "proxy_overhead",
            "sim",
            "frontier",
            "fidelity",
            "scheduler_core",
            "admit_latency",
            "engine_parser",
            "mcp_flood",
            "real_flood",
            "slot_parking",
            "routing",
            "single_pass",
            "soak",
            "faults",
            "status_page",
            "dashboard_plot",
            "store",
        ],  # fmt: skip
        help="which benchmark",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    lifeline.watch_parent()
    args.log_format_given = args.log_format or os.environ.get(logs.FORMAT_ENV)
    try:
        log_format = logs.chosen_format(args.log_format)
    except ValueError as e:
        print(f"luftpause: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logs.configure(args.log_level, log_format, service_name(args.command))
    args.func(args)


if __name__ == "__main__":
    main()
