"""The container image's HEALTHCHECK: is the luftpause service in this container answering?

One image runs every service by its subcommand, so one HEALTHCHECK has to serve them all. It
reads the container's main command (`/proc/1/cmdline`), parses it with the CLI's own parser, and
asks the route `luftpause up` polls for that service (see `luftpause.up.plan`), on loopback.
Exit status 0 when it answers 200, 1 otherwise, as Docker expects. With `LUFTPAUSE_TOKEN` set the
bearer goes along, since the runtime's /status needs it then.

    python -m luftpause.healthcheck                          # in a container
    python -m luftpause.healthcheck luftpause fake-mcp --port 9100   # any command line
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from luftpause import config
from luftpause.bearer import token_from_env
from luftpause.cli import build_parser

TIMEOUT_S = 2.0


def service_arguments(cmdline: list[str]) -> list[str]:
    """The arguments after the `luftpause` program (or `-m luftpause`) in a process's command line."""
    for i, part in enumerate(cmdline):
        if Path(part).name == "luftpause":  # the console script, or the module after `-m`
            return cmdline[i + 1 :]
    raise ValueError(f"no luftpause command in {cmdline!r}")


def health_url(arguments: list[str]) -> str:
    """The URL that answers 200 while the service these CLI arguments start is healthy."""
    args = build_parser().parse_args(arguments)
    if args.command in ("scheduler", "dataplane", "runtime"):
        from luftpause.up import plan

        conf = config.load(args.config)
        return next(c.health_url for c in plan(conf, args.config, None, False) if c.name == args.command)
    if args.command == "fake-engine" or (args.command == "fake-mcp" and not args.stdio):
        return f"http://127.0.0.1:{args.port}/health"
    raise ValueError(f"`luftpause {args.command}` serves no health route")


def main(argv: list[str] | None = None) -> int:
    cmdline = argv or Path("/proc/1/cmdline").read_bytes().decode().split("\0")[:-1]
    try:
        url = health_url(service_arguments(cmdline))
    except (ValueError, config.ConfigError, SystemExit) as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 1
    token = token_from_env()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        status = httpx.get(url, headers=headers, timeout=TIMEOUT_S).status_code
    except httpx.HTTPError as e:
        print(f"healthcheck: {url}: {e!r}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {url} answered {status}", file=sys.stderr)
    return 0 if status == 200 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or None))
