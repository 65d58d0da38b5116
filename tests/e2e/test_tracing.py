"""One trace across the three services: a whole stack (`luftpause up --with-fakes`) exporting to an
OTLP receiver of the test's own (tests/otlp_receiver.py), over OTLP/HTTP and over OTLP/gRPC.

A harness spawns a sub-agent that makes two tool calls, its MCP request carrying a `traceparent`
of its own in `_meta`. What an operator must find in that one trace, linked by parent ids: the
runtime's `invoke_agent` (under the spawn request), a `chat` span per model turn with its tokens
and finish reason and an `execute_tool` span per call under it; under each `chat`, the
dataplane's span of that turn with its held time, engine queue time and time to first token;
under each of those, the scheduler's `admit` span with the replica and held time; and under each
`execute_tool`, the tool server's own span of the call.

And the same trace across a runtime killed mid-run: the run resumed from the journal gets a new
`invoke_agent` (`luftpause.run.resumed`) under the spawn request's span, from the context its
`spawned` record carries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client
from otlp_receiver import OtlpReceiver, ReceivedSpan
from support import (
    Ports,
    call,
    http_ok,
    start_up,
    started_children,
    stop_up,
    task_planning,
    until,
    write_config,
)

TRACE_ID = "5b8efff798038103d269b633813fc60c"
CLIENT_SPAN = "eee19b7ec3c1b174"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
TOOL_CALLS = 2


def by_service(spans: list[ReceivedSpan], service: str, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.service == service and s.name == name]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_a_sub_agent_run_is_one_trace_across_runtime_dataplane_scheduler_and_tool_server(
    tmp_path, protocol
):
    """Over either OTLP protocol, as OTEL_EXPORTER_OTLP_PROTOCOL names it: a collector's default
    setup listens for gRPC (4317), the specification's default is OTLP/HTTP (4318)."""
    ports = Ports()
    with OtlpReceiver(protocol) as receiver:
        # A short batch delay, so that the spans arrive while the test waits rather than in 5 s.
        env = {**receiver.env, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        up = start_up(write_config(tmp_path, ports), tmp_path / "up.log", env=env)
        try:
            async with Client(f"http://127.0.0.1:{ports.runtime}/mcp", mode="legacy") as client:
                arguments = {
                    "task": task_planning(TOOL_CALLS, "traced"),
                    "tools": ["lookup"],
                    "maxTokens": 16,
                }
                spawned = await client.call_tool("spawn", arguments, meta={"traceparent": TRACEPARENT})
                assert not spawned.is_error, spawned.content
                handle = spawned.structured_content["handle"]
                (run,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
            assert (run["status"], run["toolCalls"]) == ("finished", TOOL_CALLS)
            turns = run["turns"]

            def whole_trace() -> bool:
                spans = receiver.received()
                return (
                    len(by_service(spans, "luftpause-runtime", "invoke_agent")) == 1
                    and len(by_service(spans, "luftpause-dataplane", "chat fake-llama")) == turns
                    and len(by_service(spans, "luftpause-scheduler", "admit")) == turns
                    and len(by_service(spans, "luftpause-fake-mcp", "tools/call lookup")) == TOOL_CALLS
                )

            await until(whole_trace, timeout_s=30, what="every span of the run at the receiver")
        finally:
            assert stop_up(up) == 0

    spans = [s for s in receiver.received() if s.trace_id == TRACE_ID]
    by_id = {s.span_id: s for s in spans}

    def ancestors(span: ReceivedSpan) -> list[ReceivedSpan]:
        chain = []
        while span.parent_id in by_id:
            span = by_id[span.parent_id]
            chain.append(span)
        return chain

    # The run, under the MCP request that spawned it, under the harness's own span.
    (agent,) = by_service(spans, "luftpause-runtime", "invoke_agent")
    spawn_request = by_id[agent.parent_id]
    assert (spawn_request.name, spawn_request.parent_id) == ("tools/call spawn", CLIENT_SPAN)
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.agent.id"] == handle
    assert agent.attributes["luftpause.run.status"] == "finished"

    # A chat span per model turn, with what its reply said.
    chats = by_service(spans, "luftpause-runtime", "chat fake-llama")
    assert len(chats) == turns == TOOL_CALLS + 1
    for chat in chats:
        assert chat.parent_id == agent.span_id
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == "fake-llama"
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0
        assert chat.attributes["gen_ai.usage.output_tokens"] > 0
    reasons = [c.attributes["gen_ai.response.finish_reasons"] for c in chats]
    # Every turn but the answer asked for tools; the answer ended (max_tokens may cut it: "length").
    assert reasons.count(["tool_calls"]) == turns - 1
    assert [r for r in reasons if r != ["tool_calls"]] in ([["stop"]], [["length"]])

    # An execute_tool span per call, and the tool server's own span of it below.
    tools = by_service(spans, "luftpause-runtime", "execute_tool lookup")
    assert len(tools) == TOOL_CALLS
    for tool in tools:
        assert tool.parent_id == agent.span_id
        assert tool.attributes["gen_ai.tool.name"] == "lookup"
        assert tool.attributes["gen_ai.tool.call.id"]
    served = by_service(spans, "luftpause-fake-mcp", "tools/call lookup")
    assert sorted(next(a.span_id for a in ancestors(s) if a in tools) for s in served) == sorted(
        t.span_id for t in tools
    )

    # The dataplane's span of each turn, under that turn's chat span.
    proxied = by_service(spans, "luftpause-dataplane", "chat fake-llama")
    assert sorted(p.parent_id for p in proxied) == sorted(c.span_id for c in chats)
    for p in proxied:
        a = p.attributes
        chat = by_id[p.parent_id]
        assert a["gen_ai.response.finish_reasons"] == chat.attributes["gen_ai.response.finish_reasons"]
        assert a["gen_ai.usage.output_tokens"] == chat.attributes["gen_ai.usage.output_tokens"]
        assert a["luftpause.outcome"] == "completed"
        assert a["luftpause.run_id"] == handle
        assert a["luftpause.replica"] in ("fake-a", "fake-b")
        assert a["luftpause.held_ms"] >= 0
        assert 0 <= a["luftpause.engine_queue_ms"] <= a["luftpause.time_to_first_token_ms"]

    # The scheduler's admit span of each turn, under the dataplane's, on the replica it went to.
    admits = by_service(spans, "luftpause-scheduler", "admit")
    assert sorted(s.parent_id for s in admits) == sorted(p.span_id for p in proxied)
    for admit in admits:
        turn = by_id[admit.parent_id]
        assert admit.attributes["luftpause.replica"] == turn.attributes["luftpause.replica"]
        assert admit.attributes["luftpause.turn_id"] == turn.attributes["luftpause.turn_id"]
        assert admit.attributes["luftpause.held_ms"] >= 0
        if admit.attributes["luftpause.reservation"]:
            assert admit.attributes["luftpause.held_ms"] == 0


def journal(directory: Path) -> list[dict]:
    """The records of the runtime's journal (state/runs.jsonl under the config's directory)."""
    path = directory / "state" / "runs.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


@pytest.mark.timeout(180)
async def test_a_run_resumed_after_kill_9_of_the_runtime_stays_in_its_trace(tmp_path):
    """The runtime is killed (SIGKILL) once the run has a tool round in the journal; `up` starts
    it again and the run resumes. Its first `invoke_agent` never ended, so it is never exported;
    what must be there is the resumed run's own, in the spawn's trace under the spawn request's
    span, with the turns made after the restart under it."""
    ports = Ports()
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        log = tmp_path / "up.log"
        up = start_up(write_config(tmp_path, ports), log, env=env)
        url = f"http://127.0.0.1:{ports.runtime}/mcp"
        try:
            async with Client(url, mode="legacy") as client:
                # Three tool calls of about a second each: the run still goes for seconds after its first round.
                arguments = {"task": task_planning(3, "resumed"), "tools": ["lookup"], "maxTokens": 16}
                spawned = await client.call_tool("spawn", arguments, meta={"traceparent": TRACEPARENT})
                assert not spawned.is_error, spawned.content
                handle = spawned.structured_content["handle"]

            def spawn_request_received() -> bool:
                return any(
                    s.trace_id == TRACE_ID and s.name == "tools/call spawn" for s in receiver.received()
                )

            await until(spawn_request_received, timeout_s=30, what="the spawn request's span at the receiver")
            await until(
                lambda: any(r["type"] == "round" and r["run"] == handle for r in journal(tmp_path)),
                timeout_s=30,
                what="a complete tool round of the run in the journal",
            )
            pid = started_children(log)["runtime"]
            os.kill(pid, signal.SIGKILL)
            await until(
                lambda: f"runtime (pid {pid}) exited" in log.read_text(), what="up to see the runtime die"
            )
            records = journal(tmp_path)
            assert not any(r["type"] == "finished" and r["run"] == handle for r in records), (
                "the run finished before the kill: nothing was resumed"
            )

            await until(lambda: "restarted runtime" in log.read_text(), timeout_s=30, what="up to restart it")
            await until(lambda: http_ok(f"http://127.0.0.1:{ports.runtime}/status"), what="the new runtime")
            async with Client(url) as client:  # a new session: the legacy one died with the runtime
                (run,) = (await call(client, "await", handles=[handle], timeout=60))["runs"]
            assert (run["status"], run["toolCalls"]) == ("finished", 3)

            def resumed_agent() -> list[ReceivedSpan]:
                return [
                    s
                    for s in by_service(receiver.received(), "luftpause-runtime", "invoke_agent")
                    if s.attributes["gen_ai.agent.id"] == handle and s.attributes["luftpause.run.resumed"]
                ]

            def answer_under_it() -> bool:
                agents = resumed_agent()
                return bool(agents) and any(
                    s.parent_id == agents[0].span_id
                    and s.attributes.get("gen_ai.response.finish_reasons") not in (None, ["tool_calls"])
                    for s in by_service(receiver.received(), "luftpause-runtime", "chat fake-llama")
                )

            await until(
                answer_under_it, timeout_s=30, what="the resumed run's span and its answer's chat span"
            )
        finally:
            assert stop_up(up) == 0

    # One resumed invoke_agent, in the spawn's trace (not a trace of its own).
    (agent,) = resumed_agent()
    assert agent.trace_id == TRACE_ID, "the resumed run's span is not in the trace it was spawned in"
    assert agent.attributes["luftpause.run.status"] == "finished"
    # Under the span of the MCP request that spawned the run (the first invoke_agent's parent too,
    # as the journaled traceparent says), itself under the harness's span.
    spans = [s for s in receiver.received() if s.trace_id == TRACE_ID]
    by_id = {s.span_id: s for s in spans}
    spawned_record = next(r for r in records if r["type"] == "spawned" and r["run"] == handle)
    spawn_request = by_id[agent.parent_id]
    assert (spawn_request.name, spawn_request.parent_id) == ("tools/call spawn", CLIENT_SPAN)
    assert spawned_record["traceparent"] == f"00-{TRACE_ID}-{spawn_request.span_id}-01"
    # Every turn made after the restart (the journal counted the ones before) is its child, the answer among them.
    turns_before = [r["turns"] for r in records if r["run"] == handle and "turns" in r][-1]
    chats = [
        s for s in by_service(spans, "luftpause-runtime", "chat fake-llama") if s.parent_id == agent.span_id
    ]
    assert len(chats) == run["turns"] - turns_before > 0
    for chat in chats:
        assert chat.attributes["gen_ai.usage.output_tokens"] > 0
    # Turns of the killed runtime that did get out sit under its lost invoke_agent, not under this one.
    first = {s.parent_id for s in by_service(spans, "luftpause-runtime", "chat fake-llama")} - {agent.span_id}
    assert len(first) <= 1 and not first & set(by_id)


def test_tracing_is_off_without_an_endpoint_and_then_loads_no_sdk():
    """Without OTEL_EXPORTER_OTLP_ENDPOINT a service installs nothing (and exports nothing): not
    even the SDK is imported. With it, the SDK's provider is installed."""
    probe = "import sys; from luftpause import tracing; print(tracing.setup('x'), 'opentelemetry.sdk' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["False", "False"]
    on_env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    on = subprocess.run([sys.executable, "-c", probe], env=on_env, capture_output=True, text=True, check=True)
    assert on.stdout.split() == ["True", "True"]


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A process that sets tracing up as a service does and says what sampler and exporter it got."""
    probe = (
        "from opentelemetry import trace; from luftpause import tracing; tracing.setup('luftpause-x'); "
        "p = trace.get_tracer_provider(); "
        "print(p.sampler.get_description(), type(p._active_span_processor._span_processors[0].span_exporter).__module__)"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True)


def test_the_protocol_and_sampler_variables_are_honoured_and_the_traces_ones_win():
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    http = _probe(endpoint)
    assert http.returncode == 0, http.stderr
    assert http.stdout.split() == ["ParentBased{root:AlwaysOnSampler,remoteParentSampled:AlwaysOnSampler,"
                                   "remoteParentNotSampled:AlwaysOffSampler,localParentSampled:AlwaysOnSampler,"
                                   "localParentNotSampled:AlwaysOffSampler}",
                                   "opentelemetry.exporter.otlp.proto.http.trace_exporter"]  # fmt: skip
    ratio = _probe({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "traceidratio",
                    "OTEL_TRACES_SAMPLER_ARG": "0.1"})  # fmt: skip
    assert ratio.returncode == 0, ratio.stderr
    assert ratio.stdout.split() == [
        "TraceIdRatioBased{0.1}",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    ]
    # The traces' own protocol variable is read before the general one, as the specification says.
    traces = _probe({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})  # fmt: skip
    assert traces.stdout.split()[-1] == "opentelemetry.exporter.otlp.proto.http.trace_exporter"


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grcp"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grcp' is not a protocol"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "'http/json' is not a protocol luftpause can export "
                                                              "traces over (the Python OTLP exporters do not speak it)"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER='jaeger_remote' is not a sampler"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "ten"}, "OTEL_TRACES_SAMPLER_ARG='ten' is not a ratio"),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "'1.5' is not a ratio"),
    ],
)  # fmt: skip
def test_a_tracing_variable_that_cannot_be_honoured_stops_the_service_naming_it(variables, said):
    """Where the SDK would log a warning and export some other way (or not at all), the service
    refuses to start, and says which variable, what it said and what it may say."""
    got = _probe({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **variables})
    assert got.returncode == 1 and got.stdout == ""
    assert got.stderr.startswith("luftpause-x: tracing: ") and said in got.stderr
    assert "use one of" in got.stderr or "give a number from 0 to 1" in got.stderr


def test_up_refuses_an_unknown_protocol_before_starting_anything(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {
        **base,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift",
    }
    config = write_config(tmp_path, Ports())
    got = subprocess.run([sys.executable, "-m", "luftpause", "up", "--config", str(config)], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert got.returncode == 2
    assert (
        "luftpause up: cannot start, nothing was started: tracing: OTEL_EXPORTER_OTLP_PROTOCOL='thrift'"
        in got.stderr
    )
    assert "use one of http/protobuf, grpc" in got.stderr
    assert "started" not in got.stdout
