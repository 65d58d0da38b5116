"""The runtime's client of the dataplane: one chat-completion turn at a time, decisions, run ends.

Turns go to `<dataplane>/v1/chat/completions`, with the run's identity in the luftpause headers
so that the scheduler sees every sub-agent turn as a turn of its run. They are streamed
(`"stream": true`, usage asked for in the last chunk), because a first token is what tells the
scheduler that the engine has started a turn and may take the next one (the lookahead,
scheduler/admission.py): with replies read whole it learnt that only as each turn ended, and let
a fan-out's first turns into the engines two at a time where a router sends them all at once.
completion_stream.py puts the chunks back together into the completion a reply not streamed
would have been, which is all the rest of the runtime sees; an endpoint that answers whole
anyway is read whole.

A 429 (a hosted API's rate limit, passed through) is retried after its Retry-After, else after
1 s, for as long as the run lives. A transient failure (the dataplane unreachable or restarting,
the connection lost or the stream ending mid-reply, a 502, 503 or 504: an engine that died, a
scheduler or dataplane on its way back) is retried with backoff from 0.25 s up to 8 s between
tries, for up to 120 s per turn; the run's cancellation (its own, or its budget's) stops the
retries at once. Anything else (another error status, an error event inside the stream), or a
transient failure that outlasts its window, ends the turn with `TurnFailed`. A retried turn is
the same request again: a model turn has no effect outside its reply. `decide` is one
`POST /v1/decide`; `models` asks `GET /v1/models` which models spawn may name. With a token
(`LUFTPAUSE_TOKEN`) every request carries it as a bearer.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from typing import Any, NoReturn

import httpx

from luftpause.lifecycle import RUN_ID_HEADER
from luftpause.runtime.completion_stream import CompletionStream, StreamError

log = logging.getLogger(__name__)

# Longest a turn may go without a byte from the dataplane, its wait for admission included, before
# its run fails (the OpenAI and Anthropic clients' default, which is as they read it too: a reply
# still streaming is never cut for its length).
TURN_TIMEOUT_S = 600.0
# Idle connections to the dataplane kept open for the next turns.
DATAPLANE_KEEPALIVE = 64
# Wait before retrying a 429 that names no Retry-After.
DEFAULT_RETRY_AFTER_S = 1.0
# How long one turn keeps retrying transient failures, and the waits between its tries.
TRANSIENT_RETRY_S = 120.0
BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# Statuses that say "not now" rather than "not this request": an engine or the scheduler away.
TRANSIENT_STATUSES = frozenset({502, 503, 504})


class TurnFailed(Exception):
    """A turn got no usable reply; the message says what the dataplane or engine answered."""


class DecideFailed(Exception):
    """The dataplane could not decide; the message says what it answered."""


class Dataplane:
    """HTTP client for the dataplane's OpenAI-compatible API."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = TURN_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else None
        # No cap on connections: each running turn holds one while the scheduler holds it for
        # admission, and a cap (httpx's default is 100) would queue turns here, unseen by the
        # scheduler's class order and fairness, behind the held ones.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=DATAPLANE_KEEPALIVE),
            transport=transport,
            headers=headers,
        )

    async def complete(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """Sends one turn, streamed, and returns the completion put together from its chunks (the
        shape of a reply not streamed); retries 429s and transient failures, raises `TurnFailed`."""
        url = f"{self.base_url}/v1/chat/completions"
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        retries = _Retries(headers.get(RUN_ID_HEADER, ""))
        while True:
            try:
                return await self._try(url, streamed, headers)
            except _Transient as e:
                await retries.after(str(e))
            except _RateLimited as e:
                log.info(
                    "run %s: 429 from the dataplane, retrying in %.1f s",
                    headers.get(RUN_ID_HEADER),
                    e.delay_s,
                )
                await asyncio.sleep(e.delay_s)

    async def _try(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """One try of a turn: its completion, or `_Transient`, `_RateLimited` or `TurnFailed`."""
        try:
            async with self._http.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _refusal(response)
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    reply = await _assembled(response)
                else:
                    # An endpoint that answers whole whatever was asked.
                    await response.aread()
                    reply = _whole(response)
        except httpx.ConnectTimeout as e:
            raise _Transient(
                f"cannot reach the dataplane at {self.base_url}: {e or 'connect timeout'}"
            ) from None
        except httpx.TimeoutException:
            raise TurnFailed(f"the dataplane sent nothing for {self._http.timeout.read:.0f} s") from None
        except httpx.TransportError as e:
            # Refused, reset, or closed mid-reply: the dataplane is down or restarting, or the
            # engine broke off (the dataplane then closes the stream unfinished).
            raise _Transient(f"cannot reach the dataplane at {self.base_url}: {e!r}") from None
        except httpx.HTTPError as e:
            raise TurnFailed(f"cannot reach the dataplane at {self.base_url}: {e}") from None
        if not isinstance(reply, dict) or not reply.get("choices"):
            raise TurnFailed("the dataplane's reply has no choices")
        return reply

    async def decide(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """One classification through `POST /v1/decide`; its JSON answer, or `DecideFailed`."""
        try:
            response = await self._http.post(f"{self.base_url}/v1/decide", json=body, headers=headers)
        except httpx.HTTPError as e:
            raise DecideFailed(f"cannot reach the dataplane at {self.base_url}: {e}") from None
        if response.status_code >= 400:
            raise DecideFailed(f"the dataplane answered {response.status_code}: {error_message(response)}")
        try:
            answer = response.json()
        except ValueError:
            raise DecideFailed("the dataplane's answer to decide is not JSON") from None
        if not isinstance(answer, dict):
            raise DecideFailed("the dataplane's answer to decide is not a JSON object")
        return answer

    async def models(self) -> list[str] | None:
        """The models the dataplane serves (`GET /v1/models`), or None when it cannot say now."""
        try:
            response = await self._http.get(f"{self.base_url}/v1/models", timeout=10.0)
            data = response.json()["data"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(data, list):
            return None
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def end_run(self, handle: str) -> None:
        """Tells the dataplane the run is over, so the scheduler forgets it now; failures are logged."""
        try:
            response = await self._http.delete(f"{self.base_url}/v1/runs/{handle}", timeout=10.0)
            if response.status_code >= 400 and response.status_code != 404:
                log.warning(
                    "run %s: ending it at the dataplane got %d: %s",
                    handle,
                    response.status_code,
                    error_message(response),
                )
        except httpx.HTTPError as e:
            log.warning("run %s: could not tell the dataplane it ended: %s", handle, e)

    async def close(self) -> None:
        await self._http.aclose()


class _Retries:
    """One turn's retries of transient failures: the backoff, and the window they must fit in."""

    def __init__(self, run_id: str) -> None:
        self._run_id = run_id
        self._tries = 0
        self._give_up_at: float | None = None

    async def after(self, problem: str) -> None:
        """Waits before the next try after `problem`; raises TurnFailed once the window is spent."""
        now = time.monotonic()
        if self._give_up_at is None:
            self._give_up_at = now + TRANSIENT_RETRY_S
        if now >= self._give_up_at:
            raise TurnFailed(f"{problem} (still so after retrying for {TRANSIENT_RETRY_S:.0f} s)")
        delay = min(BACKOFF_S[min(self._tries, len(BACKOFF_S) - 1)], self._give_up_at - now)
        self._tries += 1
        log.warning("run %s: %s; retrying in %.2f s (try %d)", self._run_id, problem, delay, self._tries + 1)
        await asyncio.sleep(delay)


class _Transient(Exception):
    """A try that failed for a passing reason; the message says what happened."""


class _RateLimited(Exception):
    def __init__(self, delay_s: float) -> None:
        super().__init__(f"rate limited for {delay_s:.1f} s")
        self.delay_s = delay_s


def _refusal(response: httpx.Response) -> NoReturn:
    """What an error status means for the turn: retry later, or fail it."""
    problem = f"the dataplane answered {response.status_code}: {error_message(response)}"
    if response.status_code in TRANSIENT_STATUSES:
        raise _Transient(problem)
    if response.status_code == 429:
        raise _RateLimited(retry_after_s(response.headers.get("retry-after")))
    raise TurnFailed(problem)


async def _assembled(response: httpx.Response) -> dict[str, Any]:
    """The completion a streamed reply adds up to; an error event in it fails the turn, and a
    stream that ends before the reply does is a reply lost on the way (transient)."""
    stream = CompletionStream()
    try:
        async for line in response.aiter_lines():
            stream.feed_line(line)
        stream.close()
    except StreamError as e:
        raise TurnFailed(f"the dataplane's stream carried an error: {e}") from None
    if not stream.finished:
        raise _Transient("the dataplane's stream ended before the reply finished")
    return stream.completion()


def _whole(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise TurnFailed(
            f"the dataplane answered {response.status_code} with a body that is not JSON"
        ) from None


def decision_of(answer: dict[str, Any]) -> dict[str, Any]:
    """The first item of a decide answer (vLLM's /classify shape) as the decide tool returns it:
    the label, each label's probability, and the labels that could not be scored."""
    data = answer.get("data")
    item = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    given = item.get("probs")
    probs: list[Any] = given if isinstance(given, list) else []
    labels = item.get("labels")
    probabilities: dict[str, float] | list[float]
    if isinstance(labels, list) and len(labels) == len(probs):
        probabilities = {str(label): float(p) for label, p in zip(labels, probs, strict=True)}
    else:
        probabilities = [float(p) for p in probs]  # a classifier's own classes, by index
    return {
        "label": item.get("label"),
        "probabilities": probabilities,
        "unscored": list(item.get("unscored") or []),
    }


def retry_after_s(value: str | None) -> float:
    """Seconds to wait for a Retry-After header (delta-seconds or an HTTP date)."""
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - time.time())
    return DEFAULT_RETRY_AFTER_S


def error_message(response: httpx.Response) -> str:
    """The message of an {"error": {"message": ...}} body, else the start of the raw body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
    text = response.text.strip()
    return text[:500] if text else response.reason_phrase
