"""The service classes are one list (luftpause.lifecycle.CLASSES), and every place a user names a
class takes exactly that list: the dataplane's class header, its OpenAPI document, spawn's
`serviceClass` (a type the runtime spells out again, as a Literal must) and `luftpause loadgen`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from luftpause import lifecycle
from luftpause.dataplane import headers
from luftpause.dataplane.errors import BadTurnRequest
from luftpause.dataplane.openapi import describe_turn_routes
from luftpause.runtime.spec import SpawnArguments


def test_spawn_takes_exactly_the_classes_the_dataplane_takes() -> None:
    schema = SpawnArguments.model_json_schema()["properties"]["serviceClass"]
    assert schema["enum"] == list(lifecycle.CLASSES)
    for name in lifecycle.CLASSES:
        assert headers.class_name(headers.service_class(name)) == name
    with pytest.raises(BadTurnRequest, match="interactive' or 'batch'"):
        headers.service_class("urgent")


def test_the_openapi_document_lists_the_classes() -> None:
    document = describe_turn_routes({"paths": {}}, "/v1/chat/completions", "/v1/decide")
    parameters = document["paths"]["/v1/chat/completions"]["post"]["parameters"]
    header = next(p for p in parameters if p["name"] == headers.SERVICE_CLASS)
    assert header["schema"]["enum"] == list(lifecycle.CLASSES)


def test_loadgen_refuses_a_class_that_is_not_one() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "luftpause", "loadgen", "--class", "urgent"], capture_output=True, text=True
    )
    assert done.returncode == 2
    refusal = done.stderr.splitlines()[-1]
    assert "invalid choice: 'urgent'" in refusal
    assert all(name in refusal for name in lifecycle.CLASSES)
