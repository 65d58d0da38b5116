"""GET /metrics, read as Prometheus reads it: turns by route, outcome and class; per class and
replica the time held for admission, the engine's time to first token and the turn's time at the
engine; and engine errors by kind."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import MODEL, Stack, answers_json, chunk, completion, streams
from prometheus_client.parser import text_string_to_metric_families
from support import until

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
HISTOGRAMS = (
    "luftpause_dataplane_admission_seconds",
    "luftpause_dataplane_engine_first_token_seconds",
    "luftpause_dataplane_turn_seconds",
)


def samples(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """The histogram `name`'s samples on replica fake-a (the only one), keyed by (sample suffix,
    class, le)."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    assert {s.labels["replica"] for s in family.samples} == {"fake-a"}
    return {
        (s.name.removeprefix(name), s.labels.get("class", ""), s.labels.get("le", "")): s.value
        for s in family.samples
    }


def counters(text: str, name: str) -> dict[tuple[str, ...], float]:
    """The counter `name`'s `_total` values, keyed by their label values in label-name order."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {
        tuple(v for _, v in sorted(s.labels.items())): s.value
        for s in family.samples
        if s.name == f"{name}_total"
    }


async def test_both_histograms_count_each_class_streamed_or_not(stack: Stack):
    async with httpx.AsyncClient() as client:
        url = f"{stack.url}/v1/chat/completions"
        stack.engine.behaviour = streams([chunk({"role": "assistant", "content": "He"}), chunk({}, "stop")])
        began = time.perf_counter()
        streamed = await client.post(url, json={**BODY, "stream": True})
        interactive_s = time.perf_counter() - began
        stack.engine.behaviour = answers_json(completion())
        began = time.perf_counter()
        whole = await client.post(url, json=BODY, headers={"x-luftpause-class": "batch"})
        batch_s = time.perf_counter() - began
        # An engine refusal has no first token: it is held and placed, but not timed to one.
        stack.engine.behaviour = answers_json({"error": {"message": "busy"}}, status=503)
        refused = await client.post(url, json=BODY, headers={"x-luftpause-class": "batch"})
        assert (streamed.status_code, whole.status_code, refused.status_code) == (200, 200, 503)
        await until(lambda: len(stack.scheduler.events) == 8, what="every turn's events")
        text = (await client.get(f"{stack.url}/metrics")).text

    held = samples(text, HISTOGRAMS[0])
    assert held["_count", "interactive", ""] == 1 and held["_count", "batch", ""] == 2
    first = samples(text, HISTOGRAMS[1])
    assert first["_count", "interactive", ""] == 1 and first["_count", "batch", ""] == 1
    assert 0 < first["_sum", "interactive", ""] <= interactive_s
    assert 0 < first["_sum", "batch", ""] <= batch_s
    # Every turn that reached the engine is timed to its end there, the refused one too.
    whole_turn = samples(text, HISTOGRAMS[2])
    assert whole_turn["_count", "interactive", ""] == 1 and whole_turn["_count", "batch", ""] == 2
    assert first["_sum", "interactive", ""] <= whole_turn["_sum", "interactive", ""] <= interactive_s
    # Buckets from 10 ms to 60 s, the same for both classes.
    for name in HISTOGRAMS:
        buckets = {le for suffix, cls, le in samples(text, name) if suffix == "_bucket" and cls == "batch"}
        assert {"0.01", "0.1", "1.0", "10.0", "60.0", "+Inf"} <= buckets


async def test_turns_count_by_outcome_and_class_and_engine_errors_by_kind(stack: Stack):
    async with httpx.AsyncClient() as client:
        url = f"{stack.url}/v1/chat/completions"
        stack.engine.behaviour = answers_json(completion())
        assert (await client.post(url, json=BODY)).status_code == 200
        stack.engine.behaviour = answers_json({"error": {"message": "busy"}}, status=503)
        batch = {"x-luftpause-class": "batch"}
        assert (await client.post(url, json=BODY, headers=batch)).status_code == 503
        stack.engine.behaviour = answers_json({"error": {"message": "slow down"}}, status=429)
        assert (await client.post(url, json=BODY, headers=batch)).status_code == 429
        # The engine breaks off mid-stream: the client's connection closes before the end.
        stack.engine.behaviour = streams([chunk({"role": "assistant", "content": "a"})], then="abort")
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(url, json={**BODY, "stream": True})
        # Refused by the dataplane itself before its class is known: a class nobody has.
        refused = await client.post(url, json=BODY, headers={"x-luftpause-class": "urgent"})
        assert refused.status_code == 400

        async def all_ended() -> str | None:
            text = (await client.get(f"{stack.url}/metrics")).text
            return text if sum(counters(text, "luftpause_dataplane_turns").values()) == 5 else None

        text = await until(all_ended, what="all five turns counted")

    turns = counters(text, "luftpause_dataplane_turns")  # (class, outcome, route)
    assert turns["interactive", "completed", "chat"] == 1
    assert turns["batch", "failed", "chat"] == 2
    assert turns["interactive", "failed", "chat"] == 1
    assert turns["unknown", "refused", "chat"] == 1
    assert sum(turns.values()) == 5
    errors = counters(text, "luftpause_dataplane_engine_errors")  # (kind, replica)
    assert errors["http_5xx", "fake-a"] == 1 and errors["http_4xx", "fake-a"] == 1
    assert errors["broke_off", "fake-a"] == 1
    assert sum(errors.values()) == 3
