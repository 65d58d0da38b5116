"""A whole stack as real processes on loopback, for the failure contract, auth and decide.

Processes: the scheduler, the dataplane (with `LUFTPAUSE_TOKEN` set), two scripted engines
(`fake_engine/scripted.py`: one answering as each request's script says, one reporting a queue so
every turn for it is held), a fake engine as a generative replica and another as a single-pass
classifier. A third generative replica, "ghost", answered its first health probe and then
closed its port; the scheduler probes only once every ten minutes, so it stays in rotation and
is the unreachable engine. "hosted" stands for a hosted API: https with a certificate of the
test's own (the services trust it through SSL_CERT_FILE), a base URL ending in /v1, its own key
and health path. Replicas and their models:

    scripted  scripted-llama   key from SCRIPTED_KEY          (scripted engine)
    plain     plain-llama      no key                         (the same scripted engine)
    busy      busy-llama       reports a queue of others: held (scripted engine --busy)
    ghost     ghost-llama      port closed after one probe
    hosted    hosted-llama     https://.../v1, key from HOSTED_KEY, health at /ready
                                                              (scripted engine over TLS)
    fake-a    fake-llama       generative fake engine
    classify  fake-classifier  single-pass fake engine

The stack is shared by every test that asks for it (one start for the session): each test
tags its requests and reads the scripted engine's log by tag.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import HealthOnly, Ports, Service, amend_config, free_port, running, wait_until, write_config

from luftpause.fake_engine import scripted

TOKEN = "test-token-0123456789"
ENGINE_KEY = "engine-key-for-scripted"
HOSTED_KEY = "hosted-api-key"
SCRIPTED_ENGINE = Path(scripted.__file__)


class ScriptProcess(Service):
    """A service that is a Python script of the tests rather than a luftpause subcommand."""

    def start(self, env: dict[str, str] | None = None) -> ScriptProcess:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        return self


def self_signed_certificate(directory: Path) -> tuple[Path, Path] | None:
    """A certificate for 127.0.0.1 signed by its own key: (certificate file, key file).

    Made with the `cryptography` package, else the `openssl` command; None when neither is
    there (the hosted replica is then left out and its test skipped).
    """
    cert_path, key_path = directory / "engine-cert.pem", directory / "engine-key.pem"
    try:
        _write_certificate(cert_path, key_path)
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            return None
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key_path),
                "-out",
                str(cert_path),
                "-days",
                "1",
                "-subj",
                "/CN=luftpause test engine",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
            ],
            check=True,
            capture_output=True,
        )
    return cert_path, key_path


def _write_certificate(cert_path: Path, key_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "luftpause test engine")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def replica(name: str, port: int, model: str, extra: str = "") -> str:
    return f'\n[[replicas]]\nname = "{name}"\nurl = "http://127.0.0.1:{port}"\nmodels = ["{model}"]\n{extra}'


@dataclass
class RealStack:
    ports: Ports
    scripted_port: int
    hosted_port: int
    # None when no certificate could be made here: then there is no hosted replica.
    ca_file: Path | None
    dataplane: str
    status_url: str
    dataplane_service: Service
    scheduler_service: Service
    tmp: Path

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        auth = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.dataplane, headers=auth, timeout=30)

    def status(self) -> dict[str, Any]:
        return httpx.get(self.status_url, timeout=5).json()

    def run_phase(self, run_id: str) -> str | None:
        r = httpx.get(f"{self.status_url}/runs/{run_id}", timeout=5)
        return r.json()["phase"] if r.status_code == 200 else None

    def engine_log(self, tag: str, hosted: bool = False) -> list[dict[str, Any]]:
        if hosted:
            entries = self._hosted_get("/_log")
        else:
            entries = httpx.get(f"http://127.0.0.1:{self.scripted_port}/_log", timeout=5).json()
        return [e for e in entries if e["tag"] == tag]

    def hosted_gets(self) -> list[str]:
        """The paths of the GETs the hosted engine was sent (the scheduler's probes)."""
        return self._hosted_get("/_gets")

    def _hosted_get(self, path: str) -> Any:
        assert self.ca_file is not None
        tls = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.get(f"https://127.0.0.1:{self.hosted_port}{path}", verify=tls, timeout=5).json()

    def turns_counted(self, route: str, outcome: str) -> float:
        """The dataplane's own count of turns on `route` that ended with `outcome`."""
        text = httpx.get(f"{self.dataplane}/metrics", timeout=5).text
        counts = [
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "luftpause_dataplane_turns_total"
            and (s.labels["route"], s.labels["outcome"]) == (route, outcome)
        ]
        assert counts, f"no luftpause_dataplane_turns_total for route {route}, outcome {outcome} in /metrics"
        return sum(counts)  # over the classes

    def settled(self) -> bool:
        doc = self.status()
        return sum(r["in_flight"] for r in doc["replicas"]) == 0 and doc["held"]["count"] == 0


@pytest.fixture(scope="session")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealStack]:
    tmp = tmp_path_factory.mktemp("dataplane-real-stack")
    ports = Ports(engines=[])
    scripted_port, busy_port, fake_port, classify_port, hosted_port = (free_port() for _ in range(5))
    certificate = self_signed_certificate(tmp)
    ghost = ThreadingHTTPServer(("127.0.0.1", free_port()), HealthOnly)
    threading.Thread(target=ghost.serve_forever, daemon=True).start()
    replicas = "".join(
        [
            replica("scripted", scripted_port, "scripted-llama", 'api_key_env = "SCRIPTED_KEY"\n'),
            replica("plain", scripted_port, "plain-llama"),
            replica("busy", busy_port, "busy-llama"),
            replica("ghost", ghost.server_port, "ghost-llama", 'metrics = "none"\n'),
            replica("fake-a", fake_port, "fake-llama"),
            replica("classify", classify_port, "fake-classifier", 'kind = "single-pass"\n'),
        ]
    )
    if certificate is not None:
        replicas += replica(
            "hosted",
            hosted_port,
            "hosted-llama",
            'api_key_env = "HOSTED_KEY"\nhealth_path = "/ready"\nmetrics = "none"\n',
        ).replace(f"http://127.0.0.1:{hosted_port}", f"https://127.0.0.1:{hosted_port}/v1")
    path = write_config(tmp, ports, extra=replicas)
    amend_config(path, "[scheduler]\nprobe_period_s = 600")

    engines = [
        ScriptProcess("scripted", [str(SCRIPTED_ENGINE), "--port", str(scripted_port)], tmp / "scripted.log"),
        ScriptProcess("busy", [str(SCRIPTED_ENGINE), "--port", str(busy_port), "--busy"], tmp / "busy.log"),
        Service("fake-a", ["fake-engine", "--name", "fake-a", "--port", str(fake_port)], tmp / "fake-a.log"),
        Service(
            "classify",
            ["fake-engine", "--name", "classify", "--model", "fake-classifier", "--port", str(classify_port)],
            tmp / "classify.log",
        ),
    ]
    plain = list(engines)
    tls_env: dict[str, str] = {}
    if certificate is not None:
        cert, key = certificate
        tls_env["SSL_CERT_FILE"] = str(cert)
        hosted_args = ["--port", str(hosted_port), "--certfile", str(cert), "--keyfile", str(key)]
        engines.append(ScriptProcess("hosted", [str(SCRIPTED_ENGINE), *hosted_args], tmp / "hosted.log"))
    scheduler = Service("scheduler", ["scheduler", "--config", str(path)], tmp / "scheduler.log")
    dataplane = Service("dataplane", ["dataplane", "--config", str(path)], tmp / "dataplane.log")
    status_url = f"http://127.0.0.1:{ports.status}/status"
    dataplane_url = f"http://127.0.0.1:{ports.dataplane}"
    try:
        with running(*engines, scheduler, dataplane):
            for engine in engines:
                engine.start()
            for engine, port in zip(plain, (scripted_port, busy_port, fake_port, classify_port), strict=True):
                engine.wait_http(f"http://127.0.0.1:{port}/health")
            if certificate is not None:
                tls = ssl.create_default_context(cafile=str(certificate[0]))

                def hosted_up() -> bool:
                    try:
                        url = f"https://127.0.0.1:{hosted_port}/health"
                        return httpx.get(url, verify=tls, timeout=1).is_success
                    except httpx.HTTPError:
                        return False

                wait_until(hosted_up, what="the hosted engine over https")
            scheduler.start(env=tls_env)
            dataplane.start(
                env={
                    "LUFTPAUSE_TOKEN": TOKEN,
                    "SCRIPTED_KEY": ENGINE_KEY,
                    "HOSTED_KEY": HOSTED_KEY,
                    **tls_env,
                }
            )
            scheduler.wait_http(status_url)
            dataplane.wait_http(f"{dataplane_url}/health")

            def all_probed() -> bool:
                return all(r["probed"] and r["healthy"] for r in httpx.get(status_url).json()["replicas"])

            wait_until(all_probed, what="every replica to pass its first probe")
            ghost.shutdown()
            ghost.server_close()
            wait_until(
                lambda: httpx.get(f"{dataplane_url}/health").json()["scheduler"] == "connected",
                what="the dataplane to connect to the scheduler",
            )
            yield RealStack(
                ports,
                scripted_port,
                hosted_port,
                certificate[0] if certificate else None,
                dataplane_url,
                status_url,
                dataplane,
                scheduler,
                tmp,
            )
    finally:
        ghost.server_close()
