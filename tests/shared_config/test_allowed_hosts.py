"""Which hosts the services answer to (luftpause/hosts.py), from the config alone."""

from __future__ import annotations

from luftpause import config as lp_config
from luftpause.hosts import HostGuard, _host_of, allowed_hosts


def _config(**extra) -> lp_config.Config:
    return lp_config.Config.model_validate(extra)


def test_loopback_and_the_names_the_config_wires_are_allowed():
    conf = _config(
        runtime={"host": "0.0.0.0", "dataplane": "http://dataplane:8080"},
        dataplane={"host": "0.0.0.0", "scheduler": "scheduler:5000"},
        scheduler={"host": "10.1.2.3"},
    )
    hosts = allowed_hosts(conf)
    assert {"localhost", "127.0.0.1", "::1", "dataplane", "scheduler", "10.1.2.3"} <= hosts
    assert "0.0.0.0" not in hosts and "evil.example" not in hosts


def test_allowed_hosts_adds_names_and_a_star_allows_any():
    assert "gpu-box.lan" in allowed_hosts(_config(allowed_hosts=["GPU-box.lan"]))
    guard = HostGuard(app=None, allowed=allowed_hosts(_config(allowed_hosts=["*"])))  # type: ignore[arg-type]
    assert guard.allows_origin("https://anything.example")


def test_host_headers_are_read_with_and_without_ports():
    assert _host_of("LocalHost:8080") == "localhost"
    assert _host_of("[::1]:7000") == "::1"
    assert _host_of("127.0.0.1") == "127.0.0.1"


def test_origins_are_judged_by_their_host():
    guard = HostGuard(app=None, allowed=allowed_hosts(_config()))  # type: ignore[arg-type]
    assert guard.allows_origin("http://127.0.0.1:5001") and guard.allows_origin("http://localhost")
    assert not guard.allows_origin("https://evil.example") and not guard.allows_origin("null")
    assert guard.allows_origin(None), "a request without an Origin is not a browser page's"
