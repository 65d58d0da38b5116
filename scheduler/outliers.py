"""Passive outlier ejection: a replica whose turns keep failing is taken out of rotation for a while.

A replica can answer its health probe and still fail every turn: close each stream after its
headers, or stream garbage (issue 29). Probes cannot see that; the turns can. So, as Envoy's
outlier detection does, the scheduler counts how each turn placed on a replica ended, as the
dataplane reports it (the core's `TurnCompleted` and `TurnFailed`, with the time of the event),
and ejects a replica whose turns fail too often:

- a turn completed counts as a success; a failed one counts as a failure only when its report
  says it was the replica's fault (`TurnFailed.replica_fault`: it could not be reached, broke
  off, sent what is not a reply, or answered 5xx). A client that left, an engine's 4xx refusal
  or an error the engine reported in its reply say nothing about the replica, and neither does
  an abandoned turn; none of them counts;
- a replica is ejected after CONSECUTIVE_FAILURES failures in a row, or when, within one
  INTERVAL_S interval, at least MIN_TURNS turns counted and FAILURE_SHARE of them or more failed;
- its n-th ejection lasts n times its base ejection time (`ejection_base_s` of the replica, the
  config's OUTLIER_EJECTION_BASE_S by default), at most MAX_MULTIPLIER times; every
  MAX_MULTIPLIER base times it then serves without an ejection take one off that count;
- when the time is up it comes back, with its counts cleared, provided its last probe found it
  healthy (else it stays out as any unhealthy replica does, until a probe passes);
- the core never ejects the last replica in service of one of its models (Envoy's maximum
  ejection percent, for pools of a few): a broken replica beside no working one still serves,
  and its failures reach the clients, who can tell.

Everything here is a pure function of a replica's `Outlier` record and the event's time; the
core (`core/`) keeps the records in its replicas and decides whether an ejection may happen.
"""

from __future__ import annotations

from typing import NamedTuple

# Failures in a row that eject a replica.
CONSECUTIVE_FAILURES = 5
# The interval over which the failure share is counted, the fewest turns it is judged on, and
# the share of them failed that ejects.
INTERVAL_S = 10.0
MIN_TURNS = 20
FAILURE_SHARE = 0.5
# An ejection lasts at most this many base ejection times.
MAX_MULTIPLIER = 10


class Outlier(NamedTuple):
    """What ejection knows of one replica: its recent outcomes and its ejections."""

    # Failures since its last success (or its return).
    consecutive: int = 0
    # The turns counted in the current interval, which began at `interval_at`, and of those the failed.
    interval_at: float = 0.0
    turns: int = 0
    failures: int = 0
    # Ejections so far, and the count its next ejection's length is reckoned from.
    ejections: int = 0
    multiplier: int = 0
    # Until when it is out of rotation; None while it is in. When it last came back.
    ejected_until: float | None = None
    back_at: float | None = None

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None


FRESH = Outlier()


def turn_ended(record: Outlier, failed: bool, at: float) -> Outlier:
    """The record after one of the replica's turns ended at `at`, a failure of its own or a success."""
    if at - record.interval_at >= INTERVAL_S:
        record = record._replace(interval_at=at, turns=0, failures=0)
    return record._replace(
        consecutive=record.consecutive + 1 if failed else 0,
        turns=record.turns + 1,
        failures=record.failures + (1 if failed else 0),
    )


def is_outlier(record: Outlier) -> bool:
    """Whether the replica's recent turns call for an ejection (it is not ejected already)."""
    if record.ejected:
        return False
    if record.consecutive >= CONSECUTIVE_FAILURES:
        return True
    return record.turns >= MIN_TURNS and record.failures >= FAILURE_SHARE * record.turns


def eject(record: Outlier, at: float, base_s: float) -> Outlier:
    """The record of a replica ejected at `at`, for its multiplier (after the decay) times `base_s`."""
    multiplier = record.multiplier
    if record.back_at is not None and multiplier:
        multiplier = max(0, multiplier - int((at - record.back_at) // (MAX_MULTIPLIER * base_s)))
    multiplier = min(multiplier + 1, MAX_MULTIPLIER)
    return record._replace(
        ejections=record.ejections + 1,
        multiplier=multiplier,
        ejected_until=at + multiplier * base_s,
    )


def comes_back(record: Outlier, at: float) -> Outlier | None:
    """The record of a replica whose ejection is over by `at`, counts cleared; None if it is not."""
    if record.ejected_until is None or at < record.ejected_until:
        return None
    return record._replace(consecutive=0, turns=0, failures=0, interval_at=at, ejected_until=None, back_at=at)
