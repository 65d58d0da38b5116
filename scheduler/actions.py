"""What the scheduler decides: the actions `decide` returns for its host to carry out.

`Place` and `Refuse` answer an admission; the others are news for logs, metrics and the
simulator (the state already reflects them). Every action names the turn or run it is about.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Place:
    """Send the turn to `replica` at `url`. `held_s` is how long it waited in the scheduler."""

    turn_id: str
    run_id: str
    replica: str
    url: str
    held_s: float


@dataclass(frozen=True, slots=True)
class Refuse:
    """No replica of the turn's kind serves its model: answer the admission with `message`, at once."""

    turn_id: str
    run_id: str
    message: str


@dataclass(frozen=True, slots=True)
class TurnExpired:
    """A placed turn was never reported done within the turn timeout; its slot is free again."""

    turn_id: str
    run_id: str
    replica: str


@dataclass(frozen=True, slots=True)
class RunForgotten:
    """The run is gone from the state: it ended ("ended") or went quiet too long ("idle")."""

    run_id: str
    reason: str


Action = Place | Refuse | TurnExpired | RunForgotten
