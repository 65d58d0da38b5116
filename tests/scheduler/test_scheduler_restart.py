"""The scheduler killed with SIGKILL in the middle of 20 agents' runs, and started again.

Real processes on loopback ports: two fake engines (slowed down, and stopped over the outage so
that the turns in them outlast it), the scheduler and the dataplane. Twenty agents keep their
own loop, the way a harness does: each sends a turn with a tool offered, answers every tool call and sends the next turn
of the same run, until the model answers in text. While turns are being generated the scheduler
is killed, and started again at once, empty. What a user of luftpause must see:

- every agent finishes, and every turn it sent was answered (none lost, none failed);
- every turn of a run ran on the replica of its first turn: runs paused on a tool when the
  scheduler died came back to their replicas;
- the restarted scheduler took the dataplane's whole view (the runs and the turns in flight that
  the dataplane resynced are what the scheduler says it has), and, with the agents held at their
  tool step, its status counts are the dataplane's: nothing in flight or held, one run paused for
  each agent waiting on its tool, the others idle.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from support import Ports, Service, running, wait_until, write_config

MODEL = "fake-llama"
AGENTS = 20
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
# Every modelled duration of the fake engines times this: a tool-call turn takes a few seconds,
# so agents are mid-run when the scheduler dies. The engines are also stopped (SIGSTOP) over the
# outage, so turns are still running when it resyncs however slowly the scheduler restarts.
TIME_SCALE = "15"


@dataclass
class Turn:
    sent_at: float
    answered_at: float = 0.0
    status: int = 0
    replica: str = ""
    finish: str = ""


@dataclass
class Agent:
    """One harness with its own loop over the dataplane; runs in a thread."""

    index: int
    dataplane: str
    gate: threading.Event
    turns: list[Turn] = field(default_factory=list)
    at_gate: bool = False
    done: bool = False
    error: str = ""

    @property
    def run_id(self) -> str:
        return f"kill-{self.index}"

    def run(self) -> None:
        messages: list[dict] = [{"role": "user", "content": f"Restart drill task number {self.index}."}]
        try:
            with httpx.Client(timeout=120) as client:
                while True:
                    turn = Turn(sent_at=time.monotonic())
                    self.turns.append(turn)
                    r = client.post(
                        f"{self.dataplane}/v1/chat/completions",
                        json={"model": MODEL, "messages": messages, "tools": [LOOKUP], "max_tokens": 8},
                        headers={
                            "x-luftpause-run-id": self.run_id,
                            "x-luftpause-caller": f"team-{self.index % 3}",
                        },
                    )
                    turn.answered_at, turn.status = time.monotonic(), r.status_code
                    turn.replica = r.headers.get("x-luftpause-replica", "")
                    if r.status_code != 200:
                        self.error = r.text
                        return
                    choice = r.json()["choices"][0]
                    turn.finish = choice["finish_reason"]
                    if turn.finish != "tool_calls":
                        return
                    message = choice["message"]
                    results = [
                        {"role": "tool", "tool_call_id": c["id"], "content": "Nothing more to find."}
                        for c in message["tool_calls"]
                    ]
                    messages += [message, *results]
                    # The tool step: held here while the test wants the world still.
                    self.at_gate = True
                    self.gate.wait()
                    self.at_gate = False
        except Exception as e:  # noqa: BLE001 (the test reports whatever stopped an agent)
            self.error = repr(e)
        finally:
            self.done = True

    def waiting_on_engine(self) -> bool:
        return bool(self.turns) and not self.turns[-1].answered_at and not self.done


def _in_flight_at_dataplane(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r"^luftpause_dataplane_turns_in_flight (\S+)$", text, re.M)
    assert match, "the dataplane's /metrics has no in-flight gauge"
    return float(match.group(1))


def _last(pattern: str, text: str) -> tuple[int, int]:
    found = re.findall(pattern, text)
    assert found, f"no line matching {pattern!r} in the log"
    runs, turns = found[-1]
    return int(runs), int(turns)


def test_a_scheduler_killed_mid_run_loses_no_turn_and_keeps_every_run_on_its_replica(tmp_path: Path):
    ports = Ports()
    # The agents wait on their tools for as long as the test needs; with the run gate on, a run
    # paused past its keep time lets go of its replica (tests/scheduler/test_gate.py). What is
    # checked here is that a restart keeps every run where it was, so the gate is off.
    path = write_config(tmp_path, ports, replica_extra="gate_min_runs = 0")
    engines = [
        Service(
            name,
            ["fake-engine", "--name", name, "--port", str(port), "--time-scale", TIME_SCALE],
            tmp_path / f"{name}.log",
        )
        for name, port in zip(("fake-a", "fake-b"), ports.engines, strict=True)
    ]
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp_path / "dataplane.log")
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"
    status_url = f"http://127.0.0.1:{ports.status}/status"

    def connected() -> bool:
        return httpx.get(f"{dataplane_url}/health", timeout=5).json()["scheduler"] == "connected"

    gate = threading.Event()
    gate.set()
    agents = [Agent(i, dataplane_url, gate) for i in range(AGENTS)]
    threads = [threading.Thread(target=a.run, name=a.run_id, daemon=True) for a in agents]

    with running(*engines, scheduler, dataplane):
        for service in (*engines, scheduler, dataplane):
            service.start()
        for e, port in zip(engines, ports.engines, strict=True):
            e.wait_http(f"http://127.0.0.1:{port}/health")
        scheduler.wait_http(status_url)
        dataplane.wait_http(f"{dataplane_url}/health")
        wait_until(connected, what="the dataplane to connect to the scheduler")
        wait_until(
            lambda: all(
                r["probed"] and r["healthy"] for r in httpx.get(status_url, timeout=5).json()["replicas"]
            ),
            what="the scheduler to find both engines healthy",
        )

        for t in threads:
            t.start()
        # Every run has paused on a tool at least once, so every run has a replica to come back to.
        wait_until(
            lambda: all(a.done or any(t.finish == "tool_calls" for t in a.turns) for a in agents),
            timeout_s=60,
            what="every agent's first turn",
        )

        # Kill while turns are running on the engines, and keep them running across the outage:
        # both engines are stopped (SIGSTOP) with turns of ours in them, so those turns cannot
        # end before the restarted scheduler has taken the dataplane's resync, however long the
        # restart takes on a busy machine. They carry on (SIGCONT) once it has.
        def frozen_with_turns_out() -> bool:
            for e in engines:
                e.send_signal(signal.SIGSTOP)
            if _in_flight_at_dataplane(dataplane_url) > 0:
                return True
            for e in engines:
                e.send_signal(signal.SIGCONT)
            return False

        wait_until(frozen_with_turns_out, timeout_s=30, interval_s=0.05, what="a turn to go out")
        in_flight_at_kill = _in_flight_at_dataplane(dataplane_url)
        killed_at = time.monotonic()
        scheduler.kill(signal.SIGKILL)
        assert sum(not a.done for a in agents) > 0, "the scheduler must die mid-run"
        scheduler.start()
        scheduler.wait_http(status_url)
        wait_until(connected, what="the dataplane to resync with the restarted scheduler")
        for e in engines:
            e.send_signal(signal.SIGCONT)

        # The restarted scheduler holds exactly what the dataplane resynced, turns in flight included.
        sent = _last(
            r"connected to scheduler at \S+ \(resynced (\d+) runs, (\d+) turns in flight\)",
            dataplane.output(),
        )
        (seen,) = httpx.get(status_url, timeout=5).json()["dataplanes"]
        taken = (seen["last_resync"]["runs"], seen["last_resync"]["turns"])
        assert (seen["resyncs"], seen["streams"]) == (1, 1)
        assert taken == sent
        assert sent[0] == AGENTS, "every run the dataplane knew was resynced"
        assert sent[1] == in_flight_at_kill > 0, "the turns running on the engines were resynced"

        # Hold the agents at their tool step until nothing moves, then compare the counts.
        gate.clear()

        def still() -> bool:
            return all(a.done or a.at_gate for a in agents) and _in_flight_at_dataplane(dataplane_url) == 0

        wait_until(still, timeout_s=60, what="every agent to finish or wait on its tool")
        waiting = [a for a in agents if a.at_gate]
        expected = {
            "in_flight": 0,
            "held": 0,
            "runs": AGENTS,
            "by_phase": {"generating": 0, "paused": len(waiting), "idle": AGENTS - len(waiting)},
        }

        def counts() -> dict:
            doc = httpx.get(status_url, timeout=5).json()
            return {
                "in_flight": sum(r["in_flight"] for r in doc["replicas"]),
                "held": doc["held"]["count"],
                "runs": doc["runs"]["count"],
                "by_phase": doc["runs"]["by_phase"],
            }

        # The dataplane reports each turn's end on its stream as it happens; the scheduler's
        # counts reach the still world a moment later.
        seen: list[dict] = []
        try:
            wait_until(lambda: seen.append(counts()) or seen[-1] == expected, timeout_s=15, what="the counts")
        except TimeoutError:
            assert seen[-1] == expected
        for a in waiting:
            run = httpx.get(f"{status_url}/runs/{a.run_id}", timeout=5).json()
            assert (run["phase"], run["replica"]) == ("paused", a.turns[0].replica)

        gate.set()
        for t in threads:
            t.join(timeout=120)

    for a in agents:
        assert a.done and not a.error, f"{a.run_id}: {a.error}"
        assert all(t.status == 200 for t in a.turns), f"{a.run_id}: a turn was not answered"
        assert a.turns[-1].finish in ("stop", "length"), f"{a.run_id} did not reach its answer"
        # The fake engine plans 1 to 3 tool calls per conversation: each was answered, and
        # every turn after the first came back to the first one's replica.
        assert 2 <= len(a.turns) <= 4, f"{a.run_id} made {len(a.turns)} turns"
        assert {t.replica for t in a.turns} == {a.turns[0].replica}, f"{a.run_id} moved: {a.turns}"
    across = [a for a in agents if any(t.sent_at < killed_at < t.answered_at for t in a.turns)]
    assert across, "some turns were in flight when the scheduler died"
    assert {a.turns[0].replica for a in agents} == {"fake-a", "fake-b"}, "both replicas served runs"
