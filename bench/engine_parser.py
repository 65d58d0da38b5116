"""The engine client's HTTP/1.1 response parser against h11's, on the bytes of a streamed turn.

The dataplane reads each engine reply with a parser of its own (`dataplane/engine_client.py`,
`_Connection`): a response head, then a chunked body whose pieces go to the client as they come.
h11 (already installed with uvicorn) is the well-kept alternative; this measures both on the
same bytes, so that the choice has figures behind it. The reply is what `proxy_canned_engine`
sends for one turn: a head and `--reply-tokens` + 3 SSE events, each its own HTTP chunk.
Two ways of arriving: one socket read per HTTP chunk (an engine streaming tokens) and the whole
reply in one read (a fast engine, or a reply read whole). Each cell times `--responses` replies
parsed one after another on one connection, body pieces taken out, in rounds that alternate the
parsers; prints the median and range of microseconds per reply over `--repeats` rounds, and
writes the record under bench/results/.

    luftpause bench engine_parser [--responses 2000] [--repeats 5] [--reply-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import h11

from luftpause.bench import results
from luftpause.bench.proxy_canned_engine import _http_chunk, _sse_events
from luftpause.dataplane.engine_client import EngineRequest, _Connection, _Origin

PATH = "/v1/chat/completions"


def reply_pieces(reply_tokens: int) -> list[bytes]:
    """One streamed turn's bytes as the engine writes them: the head, then each HTTP chunk."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    return [head, *(_http_chunk(e) for e in _sse_events(reply_tokens)), b"0\r\n\r\n"]


class _NullTransport:
    """Takes the request the connection writes and does nothing with it."""

    def write(self, data: bytes) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def ours(reads: list[bytes], responses: int) -> float:
    """Seconds to parse `responses` replies with the dataplane's own parser."""

    async def run() -> float:
        connection = _Connection()
        connection.connection_made(_NullTransport())  # type: ignore[arg-type]
        origin = _Origin("http://127.0.0.1:9")
        request = EngineRequest(url=PATH, headers={"content-type": "application/json"}, body=b"{}")
        pieces = connection._pieces
        started = time.perf_counter()
        for _ in range(responses):
            connection.send(origin, PATH, request)
            for data in reads:
                connection.data_received(data)
                while pieces:
                    pieces.popleft()
            assert connection.finished
        return time.perf_counter() - started

    return asyncio.run(run())


def theirs(reads: list[bytes], responses: int) -> float:
    """Seconds to parse `responses` replies with h11, taking out the same body pieces."""
    connection = h11.Connection(our_role=h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=PATH,
        headers=[("host", "127.0.0.1:9"), ("content-length", "2"), ("content-type", "application/json")],
    )
    started = time.perf_counter()
    for _ in range(responses):
        connection.send(request)
        connection.send(h11.Data(data=b"{}"))
        connection.send(h11.EndOfMessage())
        ended = False
        for data in reads:
            connection.receive_data(data)
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    break
                if isinstance(event, h11.Data):
                    bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    ended = True
                    break
        assert ended
        connection.start_next_cycle()
    return time.perf_counter() - started


PARSERS: dict[str, Callable[[list[bytes], int], float]] = {"luftpause": ours, "h11": theirs}


def run(responses: int, repeats: int, reply_tokens: int) -> dict[str, Any]:
    pieces = reply_pieces(reply_tokens)
    arrivals = {"a read per HTTP chunk": pieces, "the whole reply in one read": [b"".join(pieces)]}
    samples: dict[str, dict[str, list[float]]] = {a: {p: [] for p in PARSERS} for a in arrivals}
    for parse in PARSERS.values():  # warm up both
        parse(pieces, 50)
    for repeat in range(repeats):
        order = list(PARSERS) if repeat % 2 == 0 else list(reversed(PARSERS))
        for arrival, reads in arrivals.items():
            for name in order:
                samples[arrival][name].append(PARSERS[name](reads, responses) / responses * 1e6)
        print(f"  round {repeat + 1}/{repeats} done", flush=True)
    cells = []
    for arrival, by_parser in samples.items():
        for name, us in by_parser.items():
            cells.append(
                {
                    "arrival": arrival,
                    "parser": name,
                    "us_per_reply_median": round(statistics.median(us), 2),
                    "us_per_reply_range": [round(min(us), 2), round(max(us), 2)],
                    "us_per_reply": [round(u, 2) for u in us],
                }
            )
    return {
        "benchmark": "engine_parser",
        "responses": responses,
        "repeats": repeats,
        "reply_tokens": reply_tokens,
        "reply_bytes": sum(len(p) for p in pieces),
        "h11_version": h11.__version__,
        "cells": cells,
    }


def table(record: dict[str, Any]) -> str:
    lines = [
        f"Engine reply parsing, {record['reply_tokens']} tokens ({record['reply_bytes']} bytes a reply), "
        f"{record['responses']} replies a cell, median (range) of {record['repeats']} rounds",
        "",
        "| arrival | parser | µs per reply |",
        "|---|---|---|",
    ]
    for c in record["cells"]:
        low, high = c["us_per_reply_range"]
        lines.append(f"| {c['arrival']} | {c['parser']} | {c['us_per_reply_median']} ({low}-{high}) |")
    by = {(c["arrival"], c["parser"]): c["us_per_reply_median"] for c in record["cells"]}
    lines.append("")
    for arrival in dict.fromkeys(c["arrival"] for c in record["cells"]):
        lines.append(f"{arrival}: h11 takes {by[(arrival, 'h11')] / by[(arrival, 'luftpause')]:.2f}x as long")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench engine_parser", description=__doc__.split("\n")[0])
    p.add_argument("--responses", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reply-tokens", type=int, default=32)
    args = p.parse_args(argv)
    record = run(args.responses, args.repeats, args.reply_tokens)
    text = table(record)
    print(text)
    path = results.write("engine_parser", record, text)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
