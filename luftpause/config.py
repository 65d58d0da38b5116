"""The one configuration file every luftpause service reads.

A TOML file (stdlib `tomllib`) validated with pydantic. Every service starts without one, on the
embedded defaults: two fake engines and the fake MCP tool server on loopback, which is what
`luftpause up` starts. Secrets never live in the file: the bearer token comes from
`LUFTPAUSE_TOKEN` and each hosted endpoint's API key from the variable its `api_key_env` names.
Other values may name a variable as `${NAME}` or `${NAME:-default}` inside a string (a model
name, a pod's host), so that one file serves a compose recipe whose settings come from the
shell; an unset variable without a default is an error naming the key.

An invalid file raises `ConfigError`, whose message names the file, the key and what was
expected, so that a service can print it and exit.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# A replica's defaults: their home is luftpause/defaults.py, which the scheduler's core reads too.
from luftpause.defaults import GATE_MIN_RUNS as GATE_MIN_RUNS
from luftpause.defaults import LOOKAHEAD as LOOKAHEAD
from luftpause.defaults import OUTLIER_EJECTION_BASE_S as OUTLIER_EJECTION_BASE_S

# Ports from the description; the fake engines' and fake MCP's are ours, kept stable.
SCHEDULER_GRPC_PORT = 5000
SCHEDULER_STATUS_PORT = 5001
# gRPC keepalive on the dataplane's connection to the scheduler: each side pings the other after
# this long without a frame from it, and drops the connection when no answer comes within the
# timeout, so that a half-open connection (a host gone, a network cut) is found in seconds, not in
# TCP's quarter of an hour. The scheduler takes pings as often as half of it, never fewer.
SCHEDULER_KEEPALIVE_S = 10.0
SCHEDULER_KEEPALIVE_TIMEOUT_S = 5.0


def scheduler_keepalive_options() -> list[tuple[str, int]]:
    """The gRPC channel arguments of that keepalive, the same on both sides (read at each call, so
    that a test may shorten the constants): pings with calls or without, however long nothing else
    is sent. This gRPC closes a connection whose ping goes unanswered by `ping_timeout_ms` alone."""
    timeout_ms = round(SCHEDULER_KEEPALIVE_TIMEOUT_S * 1000)
    return [
        ("grpc.keepalive_time_ms", round(SCHEDULER_KEEPALIVE_S * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


DATAPLANE_PORT = 8080
RUNTIME_PORT = 7000
FAKE_ENGINE_PORTS = (9001, 9002)
FAKE_MCP_PORT = 9100
DEFAULT_MODEL = "fake-llama"
# The bearer token of the dataplane's /v1 routes and the runtime's /mcp and /status.
TOKEN_ENV = "LUFTPAUSE_TOKEN"
# A second bearer the runtime accepts, whose MCP requests see and may cancel every run.
OPERATOR_TOKEN_ENV = "LUFTPAUSE_OPERATOR_TOKEN"
# The dataplane's default bound on a request body: 16 MiB.
MAX_BODY_BYTES = 16 * 1024 * 1024
# The runtime's: an MCP request carries a tool call's arguments, not a model's context.
RUNTIME_MAX_BODY_BYTES = 4 * 1024 * 1024
# An origin as a browser names it: scheme, host and an optional port, nothing after.
_ORIGIN = re.compile(r"https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")


class ConfigError(Exception):
    """The configuration file is missing, unreadable or invalid; the message says how."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Replica(_Strict):
    """One endpoint in the engine pool: an engine, a router in front of engines, or a hosted API."""

    name: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://")
    kind: Literal["generative", "single-pass"] = "generative"
    models: list[str] = Field(min_length=1)
    health_path: str = "/health"
    # Which metric names /metrics is read with; "none" means the engine reports no load (Ollama,
    # hosted APIs): its lookahead is then kept by first tokens alone.
    metrics: Literal["sglang", "vllm", "llamacpp", "none"] = "sglang"
    # Name of the environment variable holding this endpoint's API key, sent as a bearer token.
    api_key_env: str | None = None
    # For a router: the replicas (by name) whose engines' load counts as this one's.
    load_from: list[str] = []
    # How many of our turns may wait inside this engine's own queue at once (see
    # scheduler/admission.py); 0 turns the limit off (a hosted API with room for anything).
    # Unset, it is LOOKAHEAD for a generative replica and 0 for a single-pass one: a single-pass
    # turn is one forward pass, batched with whatever waits beside it, and holds no slot that an
    # interactive run could need (the description: single-pass turns "neither hold nor wait for
    # a generative slot"), so holding it back would only add latency.
    lookahead: int = Field(default=LOOKAHEAD, ge=0, le=64)
    # Whether this engine orders its queue by the request body's `priority`, and which value
    # goes first: "sglang" (--enable-priority-scheduling: higher first), "vllm" (--scheduling-policy
    # priority, or SGLang with --schedule-low-priority-values-first: lower first). With "none"
    # the body goes as the client sent it; dataplane/priority.py has the numbers and why.
    engine_priority: Literal["none", "sglang", "vllm"] = "none"
    # Whether a streamed turn asks this engine for its usage (`stream_options.include_usage`)
    # when the client did not, which the scheduler's run gate sizes runs by; false for an engine
    # that refuses unknown `stream_options` (older Ollama builds): dataplane/usage.py.
    stream_usage: bool = True
    # Tokens of KV memory this engine has, overriding what its probes read (SGLang's
    # /get_server_info, vLLM's cache_config_info, llama.cpp's /slots). The scheduler places a new
    # run only where the runs it holds plus the new one fit (scheduler/gate.py); unset and not
    # readable from the engine, that gate is off for this replica.
    kv_tokens: int | None = Field(default=None, ge=1)
    # The gate holds runs only where this pool keeps at least this many of their size warm; below
    # that, holding them through their tools idles the engine more than their prefixes save.
    # The default is where that crossed over in the engine model (docs/architecture.md, "How a turn is
    # admitted"); an engine whose decode batch is cheaper to shrink may take a lower number.
    # 0 turns the gate off for this replica.
    gate_min_runs: int = Field(default=GATE_MIN_RUNS, ge=0, le=1000)
    # Requests this engine keeps KV for side by side, each in a slot of its own (llama.cpp's
    # `--parallel`), overriding what its /props says (`total_slots`): the gate then holds at most
    # this many runs there, whatever their size, since a run beyond them takes another's slot.
    kv_slots: int | None = Field(default=None, ge=1, le=4096)
    # Whether this engine keeps prefixes evicted from its KV in host memory and brings them back
    # (llama.cpp's `--cache-ram`, on by default there; SGLang's HiCache; vLLM's CPU offload). A
    # paused run's prefix then survives without being held, so the gate holds no runs here and
    # only the classes order the turns. Unset, SGLang's and vLLM's probes say it (prober.py) and
    # it is on for a llama.cpp replica, which does not: set it false for `llama-server
    # --cache-ram 0`. Set, the engine's word never overrides it.
    host_cache: bool | None = None
    # How long this replica is first taken out of rotation when its turns keep failing (5 in a
    # row, or half of 20 or more within 10 s, its own fault: unreachable, broken off, not a reply,
    # 5xx); each ejection lasts one more times this than the last, at most 10 times, less one for
    # every 10 times this it served since without one (scheduler/outliers.py).
    ejection_base_s: float = Field(default=OUTLIER_EJECTION_BASE_S, gt=0, le=3600)

    def keeps_host_cache(self) -> bool:
        """`host_cache`, or the engine's default where unset (llama-server's is on)."""
        return self.host_cache if self.host_cache is not None else self.metrics == "llamacpp"

    @model_validator(mode="before")
    @classmethod
    def _single_pass_takes_every_turn(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("kind") == "single-pass" and "lookahead" not in data:
            return {**data, "lookahead": 0}
        return data

    def api_key(self) -> str | None:
        """The API key from the environment, or None when no variable is configured or it is unset."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class HttpPortSettings(_Strict):
    """The bounds on a service's HTTP port, the same keys in each service's section (the dataplane's
    port, the runtime's, the scheduler's status port): luftpause/http_server.py keeps them."""

    # How long a connection may take to send a request's head, from opening or from its last
    # response (a 408 and closed beyond), and then the request's whole body (the same): a body of
    # the dataplane's max_body_bytes (16 MiB) must come at 0.6 MB/s or more; raise it for slower.
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    # How long a kept-alive connection may stay silent after a response (closed beyond).
    keep_alive_timeout_s: int = Field(default=5, ge=1)
    # How many connections may be open at once. Past it, the one waiting longest for a request
    # head is closed to make room, else the one whose request body has been arriving longest; a
    # 503 for the new one when every open one's request is whole and being answered.
    max_connections: int = Field(default=1024, ge=1)


class SchedulerSettings(HttpPortSettings):
    """The HTTP bounds (HttpPortSettings) are the status port's. The gRPC port holds at most
    `grpc_max_connections` at once (grpcio closes any more as they come), and closes a connection
    that has not begun HTTP/2 within `header_timeout_s` (scheduler/grpc_auth.py, `grpc_server`)."""

    host: str = "127.0.0.1"
    grpc_port: int = SCHEDULER_GRPC_PORT
    status_port: int = SCHEDULER_STATUS_PORT
    # Each dataplane (each worker of one) holds one connection to the gRPC port.
    grpc_max_connections: int = Field(default=256, ge=1)
    probe_period_s: float = 2.0
    # Origins (`http://host:port`) besides the page's own and the runtime's as this config names it
    # whose GET /status the status page may read when opened as `/?runtime=<url>`, with the token:
    # any other is refused on the page and never fetched (scheduler/status.py, `runtime_origins`).
    runtime_origins: list[str] = []

    @field_validator("runtime_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        bad = [o for o in origins if not _ORIGIN.fullmatch(o.rstrip("/"))]
        if bad:
            raise ValueError(f"not origins (scheme://host[:port], no path): {bad}")
        return [o.rstrip("/").lower() for o in origins]


class DataplaneSettings(HttpPortSettings):
    host: str = "127.0.0.1"
    port: int = DATAPLANE_PORT
    # host:port of the scheduler's gRPC server
    scheduler: str = f"127.0.0.1:{SCHEDULER_GRPC_PORT}"
    # The longest request body taken (413 beyond): room for a long agent context with images.
    max_body_bytes: int = Field(default=MAX_BODY_BYTES, ge=1024)
    # How long an engine may take to begin its reply (a reply read whole: its whole generation;
    # a 504 beyond), and then go without sending a byte (the stream is cut). 0: no limit.
    engine_first_byte_timeout_s: float = Field(default=600.0, ge=0)
    engine_idle_timeout_s: float = Field(default=300.0, ge=0)
    # The HTTP bounds are HttpPortSettings', with room for more connections: each stream of a
    # turn holds one.
    max_connections: int = Field(default=2048, ge=1)
    # Dataplane processes accepting on the one port, each with its own scheduler stream
    # (dataplane/workers.py); max_connections is per worker.
    workers: int = Field(default=1, ge=1, le=64)
    # What this dataplane calls itself to the scheduler, whose resync from it replaces only what
    # came through it; unset: `<machine's hostname>/<host>:<port>`, unique to each dataplane
    # process on a machine and the same across its restarts (dataplane/scheduler_client.py
    # `dataplane_name`). Set it where hostnames repeat; each dataplane sharing a scheduler its own.
    name: str = Field(default="", max_length=200)


class McpServer(_Strict):
    """An upstream MCP tool server the runtime's sub-agents may call: over HTTP or over stdio."""

    name: str = Field(min_length=1)
    url: str | None = None
    command: list[str] | None = None

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.url is None) == (self.command is None):
            raise ValueError("set exactly one of url (streamable HTTP) or command (stdio)")
        return self


class RuntimeSettings(HttpPortSettings):
    host: str = "127.0.0.1"
    port: int = RUNTIME_PORT
    # The longest request body /mcp takes (a 413 naming this key beyond); the mcp SDK's default.
    max_body_bytes: int = Field(default=RUNTIME_MAX_BODY_BYTES, ge=1024)
    dataplane: str = f"http://127.0.0.1:{DATAPLANE_PORT}"
    state_dir: str = "state"
    # Where runs are kept (runtime/store.py): "file", runs.jsonl in the state directory (one
    # runtime, no server), or a PostgreSQL URL ("postgresql://user:password@host:5432/db"), the
    # store several runtimes share (runtime/postgres_store.py). The runtime creates and migrates
    # its tables there itself.
    store: str = "file"
    # With PostgreSQL: how long a runtime's hold on a run it drives lasts unless renewed (it is
    # renewed every third of it); a runtime that stops renewing (killed, cut off) loses its runs
    # to another runtime this long after its last renewal.
    lease_s: float = Field(default=15.0, ge=1)
    default_model: str = DEFAULT_MODEL
    # How long a run tree, once all of it has ended, stays in memory before it moves to
    # archive.jsonl (and leaves runs.jsonl at the next start), from which await, status <handle>,
    # cancel and tasks/get still answer for it (runtime/journal.py, runtime/restore.py). Memory
    # is a cache of recent runs: the window decides what status without a handle and GET /status
    # list, and how many finished runs cost memory (some 4 KB of Python objects each), not what
    # can be asked. Two minutes is two of await's default timeouts, so a run that ended during
    # one await is still listed after the next; at the soak's rate (some 20 runs a minute) it
    # holds about 40. At least 60 s: eviction looks every tenth of the window, and a client needs
    # the time to list what it has just seen end.
    retention_s: float = Field(default=120.0, ge=60)
    # How long an archived run tree stays in archive.jsonl, from when its last run ended: older
    # trees are trimmed from it (at start, and by the pass that moves runs there once the oldest
    # is a tenth of the window past it), and their handles are unknown from then on. A week:
    # the archive then holds what a week of runs leaves (at the soak's rate some 200,000 runs,
    # each some 130 bytes of index in memory: 25 MB). At least retention_s.
    archive_retention_s: float = Field(default=7 * 86400.0, gt=0)
    # How deep a run tree may grow: a spawn whose parent is this many runs from its root (the
    # root counting as one) is refused. Restored trees deeper than this still load and show.
    max_depth: int = Field(default=16, ge=1)
    # Runs one caller (runtime/callers.py) may have running at once; its next spawn is refused
    # until one ends. The fan-outs and floods of loadgen and bench run at most 48 per session.
    max_running_per_caller: int = Field(default=256, ge=1)
    # How long a tool call waits for its approval before its run fails with "approval expired";
    # the deadline is journaled, so a restart neither restarts nor forgets it.
    approval_timeout_s: float = Field(default=3600.0, gt=0)
    # How long tasks/get still answers for a task after it ended (its `ttlMs`); an older one is
    # forgotten, in memory and in tasks.jsonl (rewritten without it).
    task_retention_s: float = Field(default=3600.0, gt=0)
    mcp_servers: list[McpServer] = [McpServer(name="fake-mcp", url=f"http://127.0.0.1:{FAKE_MCP_PORT}/mcp")]

    @field_validator("store")
    @classmethod
    def _store_is_known(cls, value: str) -> str:
        if value != "file" and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError(
                f'store {value!r} is neither "file" nor a PostgreSQL URL: give "file" for runs.jsonl '
                'in the state directory, or "postgresql://user:password@host:5432/database"'
            )
        return value

    @model_validator(mode="after")
    def _archive_outlives_memory(self) -> RuntimeSettings:
        if self.archive_retention_s < self.retention_s:
            raise ValueError(
                f"archive_retention_s ({self.archive_retention_s:g}) must be at least retention_s "
                f"({self.retention_s:g}): a run must not leave the archive before it leaves memory"
            )
        return self


def _embedded_replicas() -> list[Replica]:
    return [
        Replica(name=f"fake-{chr(ord('a') + i)}", url=f"http://127.0.0.1:{port}", models=[DEFAULT_MODEL])
        for i, port in enumerate(FAKE_ENGINE_PORTS)
    ]


class LoggingSettings(_Strict):
    # "text", a line for a person, or "json", an object a line for a collector (luftpause/logs.py);
    # `--log-format` and LUFTPAUSE_LOG_FORMAT, where given, come first.
    format: Literal["text", "json"] = "text"


class Config(_Strict):
    """The whole file. Each section is optional; a missing one takes the embedded defaults."""

    scheduler: SchedulerSettings = SchedulerSettings()
    dataplane: DataplaneSettings = DataplaneSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    logging: LoggingSettings = LoggingSettings()
    replicas: list[Replica] = Field(default_factory=_embedded_replicas, min_length=1)
    # Host names (or addresses) the services' HTTP routes answer to besides those the config
    # names itself and the loopback ones; ["*"]: any (luftpause/hosts.py).
    allowed_hosts: list[str] = []

    @model_validator(mode="after")
    def _names_resolve(self) -> Config:
        names = [r.name for r in self.replicas]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"replica names must be unique; repeated: {', '.join(dupes)}")
        for r in self.replicas:
            unknown = [n for n in r.load_from if n not in names]
            if unknown:
                raise ValueError(f"replica {r.name!r}: load_from names unknown replicas {unknown}")
        return self

    def replica(self, name: str) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value: object, key: str, problems: list[str]) -> object:
    """`value` with every `${NAME}` / `${NAME:-default}` in its strings replaced from the environment."""
    if isinstance(value, dict):
        return {k: _expand(v, f"{key}.{k}" if key else k, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{key}.{i}", problems) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        found = os.environ.get(name)
        if found:
            return found
        if default is not None:  # as in a shell or compose: unset or empty takes the default
            return default
        if found is None:
            problems.append(f"  {key}: ${{{name}}} is not set in the environment and has no :-default")
        return ""

    return _VARIABLE.sub(substitute, value)


def load(path: str | os.PathLike[str] | None) -> Config:
    """Reads and validates `path`; with None, returns the embedded defaults."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file; pass an existing TOML file or omit --config") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    unset: list[str] = []
    expanded = _expand(raw, "", unset)
    if unset:
        raise ConfigError(f"{p}: invalid configuration:\n" + "\n".join(unset))
    try:
        return Config.model_validate(expanded)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(part) for part in err["loc"]) or "(top level)"
            problems.append(f"  {key}: {err['msg']}")
        raise ConfigError(f"{p}: invalid configuration:\n" + "\n".join(problems)) from None
