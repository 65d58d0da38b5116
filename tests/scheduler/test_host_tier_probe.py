"""The engine's word on its host tier, end to end: a scheduler process probing two fake engine
processes that keep one (SGLang's form and vLLM's) turns the run gate off for both by itself,
with nothing in the config, and /status says who said so."""

from __future__ import annotations

from pathlib import Path

import httpx
from support import Ports, Service, free_port, running, wait_until, write_config

# A host tier twice each engine's KV pool, as SGLang's HiCache makes it by default.
TIMING = "kv_pool_tokens=32768,host_cache_tokens=65536"


def _engine(log_dir: Path, name: str, flavour: str, tier: bool) -> tuple[Service, int]:
    port = free_port()
    engine = Service(
        name,
        ["fake-engine", "--name", name, "--port", str(port), "--metrics", flavour],
        log_dir / f"{name}.log",
    )
    engine.start(env={"LUFTPAUSE_FAKE_ENGINE_TIMING": TIMING if tier else "kv_pool_tokens=32768"})
    return engine, port


def test_engines_that_keep_a_host_tier_turn_the_gate_off_by_their_own_word(tmp_path: Path):
    sglang, sglang_port = _engine(tmp_path, "fake-a", "sglang", tier=True)
    vllm, vllm_port = _engine(tmp_path, "fake-b", "vllm", tier=True)
    plain, plain_port = _engine(tmp_path, "fake-c", "sglang", tier=False)
    with running(sglang), running(vllm), running(plain):
        ports = Ports(engines=[sglang_port, vllm_port, plain_port])
        path = write_config(tmp_path, ports, extra="[scheduler]\nprobe_period_s = 0.25\n")
        text = path.read_text()
        path.write_text(
            text.replace(
                f'url = "http://127.0.0.1:{vllm_port}"\n',
                f'url = "http://127.0.0.1:{vllm_port}"\nmetrics = "vllm"\n',
                1,
            )
        )
        scheduler = Service(
            "scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log"
        ).start()
        url = f"http://127.0.0.1:{ports.status}/status"
        with running(scheduler):
            scheduler.wait_http(url)
            wait_until(
                lambda: all(r["kv_tokens"] is not None for r in httpx.get(url).json()["replicas"]),
                what="every engine's pool read by the probes",
            )
            replicas = {r["name"]: r for r in httpx.get(url).json()["replicas"]}
    said = {name: (r["host_cache"], r["host_cache_source"], r["gate"]) for name, r in replicas.items()}
    assert said == {
        "fake-a": (True, "engine", "off: host cache"),
        "fake-b": (True, "engine", "off: host cache"),
        "fake-c": (False, "engine", "tokens"),
    }
