"""Single-pass decisions: `POST /v1/decide` latency at the dataplane, 1 and 20 concurrent callers.

Two arms on one luftpause stack (`bench.stack`: the scheduler and dataplane, two generative fake
engines and a third started as a single-pass replica, `kind = "single-pass"`):

- `single-pass`: decide without labels, forwarded to the fake classifier's `/classify` (one
  prefill of the input, no decoding);
- `labels`: decide with three caller-given labels, one `max_tokens: 1` interactive turn on a
  generative fake engine scored by its first-token logprobs;
- `direct`, the baseline: the same single-pass request straight to the fake classifier's
  `/classify`, without luftpause, so that the difference is what the dataplane and the
  scheduler add.

Each caller sends one decision after another, as fast as the answers come, for `--calls`
decisions per arm and concurrency; the latency is the client's, on loopback: from sending the
request to the dataplane to the whole answer. Arms and concurrencies are interleaved within each
repeat (order rotated), after a warm-up of 20 decisions per arm. The CPU check is the fidelity
harness's, over each measured batch of calls, this process included (it is the callers). Prints
p50 and p99 per arm and concurrency with the spread over repeats; record, table and PNG under
bench/results/.

    luftpause bench single_pass [--calls 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from luftpause.bench import results
from luftpause.bench import stack as stacks
from luftpause.bench.common import spread, spread_cell
from luftpause.config import DEFAULT_MODEL

ARMS = ("direct", "single-pass", "labels")
CONCURRENCY = (1, 20)
LABELS = ["urgent", "lookup", "chat"]
WARMUP_CALLS = 20
TARGET_P99_MS = 50.0
_INPUTS = (
    "the server returned 500 three times and the on-call phone is ringing",
    "what is the population of Lyon",
    "thanks, that's all",
    "the deploy is stuck at 40 % and customers are writing in",
)


def body(arm: str, i: int) -> dict[str, Any]:
    text = f"{_INPUTS[i % len(_INPUTS)]} (#{i})"
    if arm in ("direct", "single-pass"):
        return {"model": stacks.SINGLE_PASS_MODEL, "input": text}
    return {"model": DEFAULT_MODEL, "input": text, "labels": LABELS}


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes
) -> tuple[int, bytes]:
    """One POST on a kept-alive connection; the status and the whole body (sent with a length)."""
    writer.write(head + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    reply = await reader.readuntil(b"\r\n\r\n")
    status = int(reply[9:12])
    length = 0
    for line in reply.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return status, await reader.readexactly(length)


async def measure(s: stacks.Stack, arm: str, concurrency: int, calls: int) -> list[float]:
    """`calls` decisions from `concurrency` callers; each one's latency in ms, in no order.

    Each caller is a bare asyncio HTTP/1.1 client on its own kept-alive connection (TCP_NODELAY):
    an HTTP library costs a core of its own at 20 callers, which on two cores left no window of
    the baseline arm unsaturated."""
    latencies: list[float] = []
    errors: list[str] = []
    counter = iter(range(calls))
    url, path = (s.single_pass_url, "/classify") if arm == "direct" else (s.front_url, "/v1/decide")
    assert url is not None, "the direct arm needs a stack started with the single-pass engine"
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n".encode()

    async def caller() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for i in counter:
                started = time.perf_counter()
                status, content = await _post(reader, writer, head, json.dumps(body(arm, i)).encode())
                latencies.append((time.perf_counter() - started) * 1000.0)
                if status != 200 or not json.loads(content).get("data"):
                    errors.append(f"{status}: {content[:200]!r}")
        finally:
            writer.close()

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    if errors:
        raise RuntimeError(f"{len(errors)} of {calls} decisions failed, e.g. {errors[0]}")
    return latencies


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench single_pass", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400, help="decisions per arm, concurrency and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--classifier-lookahead",
        type=int,
        default=None,
        help="the single-pass replica's `lookahead` (default: luftpause's default)",
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cells = [(arm, c) for c in CONCURRENCY for arm in ARMS]
    rows: list[dict[str, Any]] = []
    logs = Path(tempfile.mkdtemp(prefix="luftpause-single-pass-"))
    with stacks.stack(
        "luftpause", logs, single_pass=True, runtime=False, single_pass_lookahead=args.classifier_lookahead
    ) as s:
        s.single_threaded.add("classifier")
        for arm in ARMS:
            asyncio.run(measure(s, arm, 1, WARMUP_CALLS))
        for r in range(args.repeats):
            for arm, concurrency in cells[r % len(cells) :] + cells[: r % len(cells)]:
                window = stacks.CpuWindow(s, {"callers": os.getpid()})
                latencies = asyncio.run(measure(s, arm, concurrency, args.calls))
                cpu = window.close()
                row = {
                    "repeat": r,
                    "arm": arm,
                    "concurrency": concurrency,
                    "p50_ms": round(_quantile(latencies, 0.5), 2),
                    "p99_ms": round(_quantile(latencies, 0.99), 2),
                    "calls": len(latencies),
                    **cpu,
                    "counts": not cpu["saturated"],
                }
                rows.append(row)
                print(
                    f"  repeat {r + 1}/{args.repeats} {arm:<11} x{concurrency:<2}  p50 {row['p50_ms']:6.1f} ms  "
                    f"p99 {row['p99_ms']:6.1f} ms  CPU {cpu['cpu_busy']:.0%}"
                    + ("" if row["counts"] else f"  (does not count: {cpu['saturation']})"),
                    flush=True,
                )
    shutil.rmtree(logs, ignore_errors=True)
    summary: dict[str, dict[str, Any]] = {}
    lines = [
        f"/v1/decide at the dataplane, {args.calls} decisions per cell, {args.repeats} repeat(s) interleaved, "
        f"classifier lookahead {'default' if args.classifier_lookahead is None else args.classifier_lookahead}; "
        "median (range) over the repeats that count",
        "",
        "| decision | callers | p50 ms | p99 ms | repeats counted |",
        "|---|---|---|---|---|",
    ]
    for arm, concurrency in cells:
        counted = [x for x in rows if x["arm"] == arm and x["concurrency"] == concurrency and x["counts"]]
        p50, p99 = spread([x["p50_ms"] for x in counted]), spread([x["p99_ms"] for x in counted])
        summary[f"{arm}@{concurrency}"] = {"p50_ms": p50, "p99_ms": p99, "counted": len(counted)}
        label = {
            "direct": "straight to the fake classifier, no luftpause",
            "single-pass": "single-pass replica",
            "labels": "labels on a generative replica",
        }[arm]
        lines.append(
            f"| {label} | {concurrency} | {spread_cell(p50)} | {spread_cell(p99)} | {len(counted)} of {args.repeats} |"
        )
    target = summary[f"single-pass@{CONCURRENCY[-1]}"]["p99_ms"]["median"]
    verdict = (
        "no verdict: no repeat counted"
        if target is None
        else f"{'met' if target < TARGET_P99_MS else 'not met'}: single-pass p99 at {CONCURRENCY[-1]} callers "
        f"{target:.1f} ms (under {TARGET_P99_MS:g} ms asked)"
    )
    lines += ["", verdict + "."]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record = {"options": vars(args), "rows": rows, "summary": summary, "verdict": verdict}
        results.write_with_bars(
            "single_pass",
            record,
            text,
            "/v1/decide at the dataplane: p99 per repeat that counts (luftpause in both)",
            "p99 latency, ms",
            {
                f"{arm}, {c} caller{'s' if c > 1 else ''}": [
                    x["p99_ms"] for x in rows if x["arm"] == arm and x["concurrency"] == c and x["counts"]
                ]
                for arm, c in cells
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
