"""server.json, the MCP Registry entry: valid against the registry's published schema (vendored
in tests/deploy/schemas/), and naming what the release and compose recipes actually ship."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from luftpause import config
from luftpause.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).parent / "schemas"
# The published file's digest, as tests/deploy/schemas/README.md records it.
SCHEMA_SHA256 = {
    "server.schema.2025-12-11.json": "3fba09590c99f61735d234822279f4223fab9e300c0a81e81c91ab62a4114de0"
}


def _entry() -> dict:
    return json.loads((ROOT / "server.json").read_text())


def _validator(entry: dict) -> jsonschema.Draft7Validator:
    """The vendored schema whose $id is the entry's $schema."""
    for name, digest in SCHEMA_SHA256.items():
        raw = (SCHEMAS / name).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == digest, f"{name} differs from the published schema"
        schema = json.loads(raw)
        if schema["$id"] == entry["$schema"]:
            return jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())
    raise AssertionError(f"no vendored schema for {entry['$schema']}")


def test_server_json_validates_against_the_registry_schema() -> None:
    entry = _entry()
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(entry).iter_errors(entry)
    ]
    assert errors == []


@pytest.mark.parametrize(
    "spoil",
    [
        lambda e: e.update(name="luftpause"),  # no namespace
        lambda e: e.update(description="x" * 101),  # longer than the registry allows
        lambda e: e["packages"][0].pop("transport"),
        lambda e: e["remotes"][0].update(url="localhost:7000/mcp"),  # not an http(s) URL
    ],
)
def test_the_schema_check_refuses_a_spoilt_entry(spoil) -> None:
    entry = copy.deepcopy(_entry())
    spoil(entry)
    assert list(_validator(entry).iter_errors(entry))


def test_the_entry_names_what_a_release_ships() -> None:
    entry = _entry()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert entry["version"] == version
    assert re.fullmatch(r"io\.github\.[\w-]+/luftpause", entry["name"])
    label = re.search(r'io\.modelcontextprotocol\.server\.name="([^"]+)"', (ROOT / "Dockerfile").read_text())
    assert label and label[1] == entry["name"], "the image's label must prove it belongs to this entry"

    template = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["runtime"]["image"]
    image = re.sub(
        r"\$\{(\w+):-([^}]*)\}", lambda m: f"v{version}" if m[1] == "LUFTPAUSE_VERSION" else m[2], template
    )
    (package,) = entry["packages"]
    assert package["registryType"] == "oci" and package["identifier"] == image
    arguments = [a["value"] for a in package["packageArguments"]]
    assert build_parser().parse_args(arguments).command == "runtime"

    for url in [r["url"] for r in entry["remotes"]] + [package["transport"]["url"]]:
        parts = urlsplit(url)
        assert parts.port == config.RUNTIME_PORT and parts.path == "/mcp", url
    assert {h["name"] for h in entry["remotes"][0]["headers"]} == {"Authorization"}
