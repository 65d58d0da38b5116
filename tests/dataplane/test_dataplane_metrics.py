"""GET /metrics per service class: time held for admission, and the engine's time to first token."""

from __future__ import annotations

import time

import httpx
from conftest import MODEL, Stack, answers_json, chunk, completion, streams
from prometheus_client.parser import text_string_to_metric_families
from support import until

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
HISTOGRAMS = ("luftpause_dataplane_admission_seconds", "luftpause_dataplane_engine_first_token_seconds")


def samples(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """The histogram `name`'s samples, keyed by (sample suffix, class, le)."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {
        (s.name.removeprefix(name), s.labels.get("class", ""), s.labels.get("le", "")): s.value
        for s in family.samples
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
    # Buckets from 10 ms to 60 s, the same for both classes.
    for name in HISTOGRAMS:
        buckets = {le for suffix, cls, le in samples(text, name) if suffix == "_bucket" and cls == "batch"}
        assert {"0.01", "0.1", "1.0", "10.0", "60.0", "+Inf"} <= buckets
