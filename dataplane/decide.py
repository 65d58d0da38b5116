"""`POST /v1/decide`: a decision without a generated reply, in vLLM's `/classify` shape.

Request: `{"model": M, "input": "text" or ["text", ...], "labels": [optional, 2 to 20]}`.

- Without labels, the turn goes to a single-pass replica serving M (a classifier behind vLLM's
  `/classify`): the body is forwarded unchanged and the classifier's answer comes back unchanged,
  `{"data": [{"index", "label", "probs", "num_classes"}, ...], "usage": ...}`.
- With labels, there is no classifier for them: one `max_tokens: 1` interactive turn on a
  generative replica serving M asks for the label, and each label is scored by the logprob of
  the first-token alternative it begins with. The answer has the same shape, one item for the
  one input, with `probs` in the order of `labels` (renormalised over the labels that could be
  scored), and `labels` and `unscored` (the labels no alternative began with, probability 0).
  When no label could be scored, `label` is null.

Decide turns stay outside run state: single-pass ones by their kind, labelled ones because the
scheduler is not told their run, so a run paused on a tool stays paused while it decides. The
response still carries `x-luftpause-run-id` (the header's, else a new one), as every turn's does.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from luftpause.dataplane.answer import Answer
from luftpause.dataplane.errors import BadTurnRequest
from luftpause.dataplane.proxy import Proxy
from luftpause.dataplane.turn import ProxiedTurn, request_object
from luftpause.proto import pb

MIN_LABELS, MAX_LABELS = 2, 20
# OpenAI's ceiling on top_logprobs; the more alternatives, the more labels can be scored.
TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class DecideRequest:
    model: str
    inputs: list[str]
    labels: list[str] | None


def parse_decide(body: bytes) -> DecideRequest:
    """Reads a decide body; BadTurnRequest names what is wrong with it."""
    payload = request_object(body)
    model = payload["model"]
    raw_input = payload.get("input")
    inputs = [raw_input] if isinstance(raw_input, str) else raw_input
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise BadTurnRequest('"input" must be a string or a non-empty list of strings')
    labels = payload.get("labels")
    if labels is not None:
        if (
            not isinstance(labels, list)
            or not all(isinstance(label, str) and label.strip() for label in labels)
            or not MIN_LABELS <= len(labels) <= MAX_LABELS
            or len({label.strip().lower() for label in labels}) != len(labels)
        ):
            raise BadTurnRequest(f'"labels" must be {MIN_LABELS} to {MAX_LABELS} different non-empty strings')
        if len(inputs) != 1:
            raise BadTurnRequest('with "labels", "input" must be one text: each decision is one turn')
    return DecideRequest(model, inputs, labels)


def label_prompt(text: str, labels: list[str]) -> list[dict[str, str]]:
    """The messages of a labelled decision: the model is to answer with one label's first token."""
    listed = ", ".join(labels)
    return [
        {
            "role": "system",
            "content": f"Classify the user's input. Answer with exactly one of these labels and nothing else: {listed}.",
        },
        {"role": "user", "content": f"{text}\n\nLabels: {listed}\nLabel:"},
    ]


def score_labels(reply: Any, labels: list[str]) -> dict[str, Any]:
    """One decide item from a one-token reply's first-token logprobs.

    A label is scored by the most specific alternative it begins with (case and surrounding
    space ignored), e.g. "urg" for "urgent"; labels that share that alternative share its score.
    """
    alternatives: list[tuple[str, float]] = []
    for entry in _first_token_logprobs(reply):
        token, logprob = entry.get("token"), entry.get("logprob")
        if (
            isinstance(token, str)
            and token.strip()
            and isinstance(logprob, int | float)
            and math.isfinite(logprob)
        ):
            alternatives.append((token.strip().lower(), float(logprob)))
    scores: dict[str, float] = {}
    for label in labels:
        wanted = label.strip().lower()
        matches = [(len(token), logprob) for token, logprob in alternatives if wanted.startswith(token)]
        if matches:
            scores[label] = max(matches)[1]
    total = sum(math.exp(s) for s in scores.values())
    probs = [math.exp(scores[label]) / total if label in scores else 0.0 for label in labels]
    best = max(scores, key=lambda label: scores[label]) if scores else None
    return {
        "index": 0,
        "label": best,
        "probs": probs,
        "num_classes": len(labels),
        "labels": labels,
        "unscored": [label for label in labels if label not in scores],
    }


def _first_token_logprobs(reply: Any) -> list[dict[str, Any]]:
    try:
        first = reply["choices"][0]["logprobs"]["content"][0]
    except (KeyError, IndexError, TypeError):
        return []
    if not isinstance(first, dict):
        return []
    alternatives = first.get("top_logprobs")
    entries = list(alternatives) if isinstance(alternatives, list) else []
    return [e for e in [first, *entries] if isinstance(e, dict)]


class Decide:
    """The ASGI endpoint behind `POST /v1/decide`, running its turns through the proxy's path."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = await self.proxy.read_request(scope, receive, send, "decide", parse_decide)
        if incoming is None:
            return
        decision, body, answer = incoming.parsed, incoming.body, incoming.answer
        labelled = decision.labels is not None
        turn = incoming.turn(
            # A labelled decision is someone waiting on one token: it goes as interactive.
            service_class=pb.INTERACTIVE if labelled else incoming.service_class,
            model=decision.model,
            route="decide",
            kind=pb.GENERATIVE if labelled else pb.SINGLE_PASS,
            scheduled_run_id="",
            # A labelled decision asks the engine for one token (`_score`).
            max_tokens=1 if labelled else 0,
        )

        async def work(placement: pb.AdmitReply, client_left: asyncio.Future[None]) -> None:
            if decision.labels is None:
                await self._classify(turn, placement, body, answer, client_left)
            else:
                await self._score(turn, placement, decision, decision.labels, answer, client_left)

        await self.proxy.run_turn(turn, answer, receive, work)

    async def _classify(
        self,
        turn: ProxiedTurn,
        placement: pb.AdmitReply,
        body: bytes,
        answer: Answer,
        client_left: asyncio.Future[None],
    ) -> None:
        proxy = self.proxy
        # vLLM serves /classify at its root, beside /v1, not under it.
        request = proxy.engine_request(turn, placement, "/classify", body)
        fetched = await proxy.fetch_whole(turn, request, answer, client_left)
        if fetched is None:
            return
        content, upstream = fetched
        if await proxy.end_whole(turn, content, answer):
            await answer.respond(content, upstream)

    async def _score(
        self,
        turn: ProxiedTurn,
        placement: pb.AdmitReply,
        decision: DecideRequest,
        labels: list[str],
        answer: Answer,
        client_left: asyncio.Future[None],
    ) -> None:
        proxy = self.proxy
        chat = {
            "model": decision.model,
            "messages": label_prompt(decision.inputs[0], labels),
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
            "stream": False,
        }
        request = proxy.engine_request(turn, placement, "chat/completions", json.dumps(chat).encode())
        fetched = await proxy.fetch_whole(turn, request, answer, client_left)
        if fetched is None:
            return
        content, _ = fetched
        if not await proxy.end_whole(turn, content, answer):
            return
        reply = json.loads(content)
        usage = reply.get("usage") if isinstance(reply, dict) else None
        await answer.respond_json(
            {
                "id": "decide-" + turn.id,
                "object": "list",
                "created": int(time.time()),
                "model": decision.model,
                "data": [score_labels(reply, labels)],
                "usage": usage,
            }
        )
