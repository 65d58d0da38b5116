"""Sub-agents spawned together start together: the runtime streams its turns, so the scheduler
hears of each turn's first token while the turn is still generating.

Real processes: scheduler, dataplane, one slow fake engine (ten times the modelled time: a tool
call takes about a second to write), fake-mcp, and the runtime. The engine is declared with no
load metrics and a lookahead of 1, so the only thing that lets the scheduler send it a second
turn while the first still runs is the first one's first token (scheduler/admission.py): with
replies read whole, a turn counted as waiting in the engine until it ended, and the sub-agents'
turns went in one at a time.
"""

import httpx
from mcp import Client
from support import Ports, Service, call, free_port, running, task_planning, until, wait_until, write_config

RUNS = 3


async def test_sub_agents_spawned_together_run_in_the_engine_together(tmp_path):
    ports = Ports(engines=[free_port()])
    # One engine that reports no load, with room kept for one unconfirmed turn: only first tokens
    # tell the scheduler that the engine took a turn.
    config = str(write_config(tmp_path, ports, replica_extra='metrics = "none"\nlookahead = 1'))
    engine = Service(
        "fake-a",
        ["fake-engine", "--name", "fake-a", "--port", str(ports.engines[0]), "--time-scale", "10"],
        tmp_path / "engine.log",
    )
    tools = Service(
        "fake-mcp",
        ["fake-mcp", "--port", str(ports.fake_mcp), "--fixed-latency-s", "0.2"],
        tmp_path / "m.log",
    )
    scheduler = Service("scheduler", ["scheduler", "--config", config], tmp_path / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", config], tmp_path / "dataplane.log")
    runtime = Service("runtime", ["runtime", "--config", config], tmp_path / "runtime.log")
    status_url = f"http://127.0.0.1:{ports.status}/status"
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"

    with running(engine, tools, scheduler, dataplane, runtime):
        engine.start(), tools.start(), scheduler.start(), dataplane.start()
        engine.wait_http(f"http://127.0.0.1:{ports.engines[0]}/health")
        tools.wait_http(f"http://127.0.0.1:{ports.fake_mcp}/health")
        scheduler.wait_http(status_url)
        dataplane.wait_http(f"{dataplane_url}/health")
        wait_until(
            lambda: httpx.get(f"{dataplane_url}/health", timeout=5).json()["scheduler"] == "connected",
            what="the dataplane to connect to the scheduler",
        )
        runtime.start()
        runtime.wait_http(f"http://127.0.0.1:{ports.runtime}/status")

        async with (
            httpx.AsyncClient(timeout=5) as http,
            Client(f"http://127.0.0.1:{ports.runtime}/mcp") as client,
        ):

            async def replica() -> dict | None:
                document = (await http.get(status_url)).json()
                (fake_a,) = document["replicas"]
                running = fake_a["in_flight"] == RUNS and fake_a["waiting_ours"] == 0
                return document if running else None

            tasks = [task_planning(1, f"together {i}") for i in range(RUNS)]
            handles = [(await call(client, "spawn", task=t, maxTokens=16))["handle"] for t in tasks]
            # All three first turns in the engine at once, each known to be running there (its
            # first token seen): none counts against the lookahead of 1, none is held back.
            together = await until(replica, timeout_s=20, what=f"{RUNS} sub-agent turns running at once")
            assert together["held"]["count"] == 0
            awaited = await call(client, "await", handles=handles, timeout=60)

    assert [(r["status"], r["error"], r["toolCalls"]) for r in awaited["runs"]] == [
        ("finished", None, 1)
    ] * RUNS
