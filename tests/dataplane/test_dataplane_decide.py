"""POST /v1/decide: a classifier's labels through a single-pass replica, or caller-given labels
scored from a generative replica's first-token logprobs; end to end on `real_stack.py`, and the
scoring itself on hand-made replies."""

from __future__ import annotations

import math

import httpx
import pytest
from real_stack import RealStack

from luftpause.dataplane.decide import parse_decide, score_labels
from luftpause.dataplane.errors import BadTurnRequest
from luftpause.fake_engine.classify import DEFAULT_LABELS


def test_without_labels_the_classifier_answers_in_its_own_shape(real_stack: RealStack):
    runs = real_stack.status()["runs"]["count"]
    with real_stack.client() as client:
        r = client.post(
            "/v1/decide",
            json={"model": "fake-classifier", "input": ["the server is down", "how tall is it"]},
            headers={"x-luftpause-run-id": "deciding-run"},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-luftpause-run-id"] == "deciding-run"
    assert r.headers["x-luftpause-replica"] == "classify"
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    for item in body["data"]:
        assert item["label"] in DEFAULT_LABELS and item["num_classes"] == len(DEFAULT_LABELS)
        assert math.isclose(sum(item["probs"]), 1.0)
    assert body["usage"]["prompt_tokens"] > 0
    # Single-pass turns never enter run state.
    assert real_stack.status()["runs"]["count"] == runs
    assert real_stack.run_phase("deciding-run") is None


def test_with_labels_one_token_on_a_generative_replica_scores_them(real_stack: RealStack):
    labels = ["urgent", "lookup", "chat"]
    with real_stack.client() as client:
        r = client.post(
            "/v1/decide",
            json={"model": "fake-llama", "input": "the server returned 500 three times", "labels": labels},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-luftpause-replica"] == "fake-a"
    assert len(r.headers["x-luftpause-run-id"]) == 32
    (item,) = r.json()["data"]
    assert item["labels"] == labels and item["num_classes"] == 3
    scored = [p for label, p in zip(labels, item["probs"], strict=True) if label not in item["unscored"]]
    assert scored, "the fake engine offers every word of the prompt as a first-token alternative"
    assert math.isclose(sum(scored), 1.0)
    assert item["label"] == labels[item["probs"].index(max(item["probs"]))]
    assert r.json()["usage"]["completion_tokens"] == 1


def test_decide_refusals(real_stack: RealStack):
    with real_stack.client() as client:
        unknown_classifier = client.post("/v1/decide", json={"model": "fake-llama", "input": "x"})
        unknown_generator = client.post(
            "/v1/decide", json={"model": "fake-classifier", "input": "x", "labels": ["a", "b"]}
        )
        one_label = client.post("/v1/decide", json={"model": "fake-llama", "input": "x", "labels": ["a"]})
    assert unknown_classifier.status_code == 404
    assert unknown_classifier.json()["error"]["message"] == "no SinglePass replica serves model 'fake-llama'"
    assert unknown_classifier.headers["x-luftpause-run-id"]
    assert unknown_generator.status_code == 404
    assert (
        unknown_generator.json()["error"]["message"] == "no Generative replica serves model 'fake-classifier'"
    )
    assert one_label.status_code == 400 and "2 to 20" in one_label.json()["error"]["message"]


def _reply(alternatives: dict[str, float]) -> dict:
    first = next(iter(alternatives))
    return {
        "choices": [
            {
                "message": {"role": "assistant", "content": first},
                "logprobs": {
                    "content": [
                        {
                            "token": first,
                            "logprob": alternatives[first],
                            "top_logprobs": [{"token": t, "logprob": lp} for t, lp in alternatives.items()],
                        }
                    ]
                },
            }
        ]
    }


def test_labels_are_scored_by_the_alternative_they_begin_with():
    item = score_labels(
        _reply({" Urg": math.log(0.6), "look": math.log(0.2), "the": math.log(0.1)}),
        ["urgent", "lookup", "chat"],
    )
    assert item["label"] == "urgent"
    assert item["unscored"] == ["chat"]
    assert item["probs"][2] == 0.0
    assert math.isclose(item["probs"][0], 0.75) and math.isclose(item["probs"][1], 0.25)


def test_the_most_specific_alternative_wins():
    item = score_labels(
        _reply({"l": math.log(0.5), "lookup": math.log(0.1), "chat": math.log(0.1)}), ["lookup", "chat"]
    )
    assert math.isclose(item["probs"][0], 0.5)


def test_no_logprobs_means_no_label():
    item = score_labels({"choices": [{"message": {"content": "x"}}]}, ["a", "b"])
    assert item["label"] is None and item["unscored"] == ["a", "b"] and item["probs"] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"nope", "JSON"),
        (b'{"input": "x"}', '"model"'),
        (b'{"model": "m"}', '"input"'),
        (b'{"model": "m", "input": []}', '"input"'),
        (b'{"model": "m", "input": "x", "labels": ["a", "A"]}', "different"),
        (
            b'{"model": "m", "input": "x", "labels": '
            + str([f"l{i}" for i in range(21)]).replace("'", '"').encode()
            + b"}",
            "2 to 20",
        ),
        (b'{"model": "m", "input": ["x", "y"], "labels": ["a", "b"]}', "one text"),
    ],
)
def test_bad_decide_bodies_name_the_problem(body: bytes, problem: str):
    with pytest.raises(BadTurnRequest, match=problem):
        parse_decide(body)


def test_a_decide_turn_follows_the_failure_contract_too(real_stack: RealStack):
    failed = real_stack.turns_counted("decide", "failed")
    with real_stack.client() as client:
        r = client.post(
            "/v1/decide",
            json={"model": "ghost-llama", "input": "x", "labels": ["a", "b"]},
            headers={"x-luftpause-run-id": "decide-ghost"},
        )
    assert r.status_code == 502
    assert r.json()["error"]["message"].startswith("engine ghost: connect to 127.0.0.1:")
    assert r.headers["x-luftpause-run-id"] == "decide-ghost"
    assert real_stack.turns_counted("decide", "failed") == failed + 1


def test_a_decide_reply_that_is_not_json_is_a_502_naming_the_replica(real_stack: RealStack):
    failed = real_stack.turns_counted("decide", "failed")
    always = f"http://127.0.0.1:{real_stack.scripted_port}/_always"
    httpx.post(always, content=b"garbage", timeout=5).raise_for_status()
    try:
        with real_stack.client() as client:
            r = client.post(
                "/v1/decide", json={"model": "scripted-llama", "input": "x", "labels": ["a", "b"]}
            )
    finally:
        httpx.post(always, content=b"", timeout=5).raise_for_status()
    # Not scored as if the engine had offered no alternative: the engine's failure, said so.
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"].startswith("engine scripted: its reply is not a JSON object")
    assert r.headers["x-luftpause-replica"] == "scripted"
    assert real_stack.turns_counted("decide", "failed") == failed + 1
