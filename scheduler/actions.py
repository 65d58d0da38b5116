"""What the scheduler decides: the actions `decide` returns for its host to carry out.

`Place` and `Refuse` answer an admission; `Reserved` and `Revoked` go to a dataplane's stream
(room it may use without asking, and room it must give back); the others are news for logs, metrics and the
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
    # The reservation of its dataplane's it took the room of ("" for none): see core.reserve.
    reservation_id: str = ""
    # The engine slot its request names (llama.cpp's `id_slot`), None for none: core.place._slot_for.
    slot: int | None = None


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


@dataclass(frozen=True, slots=True)
class Reserved:
    """Tell `dataplane` it may send one turn to `replica` without asking (`reservation_id`)."""

    reservation_id: str
    dataplane: str
    replica: str
    url: str
    models: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Revoked:
    """Tell `dataplane` to give these reservations back: a turn is held now."""

    dataplane: str
    reservation_ids: tuple[str, ...]


Action = Place | Refuse | TurnExpired | RunForgotten | Reserved | Revoked
