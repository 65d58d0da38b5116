"""The image's HEALTHCHECK asks each service on the route `luftpause up` watches, and fails when it is down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import Ports, Service, free_port, running, write_config

from luftpause import config, healthcheck
from luftpause.up import plan


@pytest.mark.parametrize(
    "cmdline",
    [
        ["/opt/luftpause/bin/python", "/opt/luftpause/bin/luftpause", "dataplane", "--config", "c.toml"],
        ["/sbin/docker-init", "--", "luftpause", "dataplane", "--config", "c.toml"],
        ["python3", "-m", "luftpause", "dataplane", "--config", "c.toml"],
    ],
)
def test_the_service_is_found_in_the_containers_command(cmdline: list[str]) -> None:
    assert healthcheck.service_arguments(cmdline) == ["dataplane", "--config", "c.toml"]


def test_each_luftpause_service_is_asked_where_up_asks_it(tmp_path: Path) -> None:
    conf_path = write_config(tmp_path, Ports())
    children = {c.name: c.health_url for c in plan(config.load(conf_path), str(conf_path), None, False)}
    for service in ("scheduler", "dataplane", "runtime"):
        assert healthcheck.health_url([service, "--config", str(conf_path)]) == children[service]
    assert healthcheck.health_url(["fake-mcp", "--port", "9333"]) == "http://127.0.0.1:9333/health"
    with pytest.raises(ValueError, match="no health route"):
        healthcheck.health_url(["fake-mcp", "--stdio"])


def _check(*arguments: str) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "luftpause.healthcheck", "luftpause", *arguments],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode


def test_healthy_while_the_service_answers_and_unhealthy_once_it_is_gone(tmp_path: Path) -> None:
    port = free_port()
    engine = Service("fake-engine", ["fake-engine", "--port", str(port)], tmp_path / "engine.log")
    with running(engine.start()):
        engine.wait_http(f"http://127.0.0.1:{port}/health")
        assert _check("fake-engine", "--port", str(port)) == 0
    assert _check("fake-engine", "--port", str(port)) == 1
    assert _check("no-such-service") == 1


def test_the_runtime_is_asked_with_the_bearer_when_a_token_is_set(tmp_path: Path) -> None:
    ports = Ports()
    conf_path = write_config(tmp_path, ports)
    runtime = Service("runtime", ["runtime", "--config", str(conf_path)], tmp_path / "runtime.log")
    with running(runtime.start(env={"LUFTPAUSE_TOKEN": "s3cret"})):
        runtime.wait_tcp(ports.runtime)
        with_token = subprocess.run(
            [
                sys.executable,
                "-m",
                "luftpause.healthcheck",
                "luftpause",
                "runtime",
                "--config",
                str(conf_path),
            ],
            env={**os.environ, "LUFTPAUSE_TOKEN": "s3cret"},
            timeout=30,
        )
        without = subprocess.run(
            [
                sys.executable,
                "-m",
                "luftpause.healthcheck",
                "luftpause",
                "runtime",
                "--config",
                str(conf_path),
            ],
            env={k: v for k, v in os.environ.items() if k != "LUFTPAUSE_TOKEN"},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert with_token.returncode == 0
    assert without.returncode == 1 and "answered 401" in without.stderr
