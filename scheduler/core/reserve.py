"""Reservations: room set aside for a dataplane while nothing is held, and taken back when
something is; the events that ask for, use and give back reservations, and a dataplane leaving.

A turn admitted the usual way waits a round trip to the scheduler before its engine request
goes out, though while nothing is held the answer is foregone: the run's replica, if it has
room. So a dataplane that asks for reservations (`ReservationsWanted`) gets reservations on
each replica its turns have been placed on, while that replica has room for a batch turn
(the stricter class) and nothing is held anywhere: one at a time to each dataplane in turn,
at most the replica's lookahead each, and where more than one dataplane wants them never
the replica's last turn of room, which stays free for whichever asks. A dataplane wants them
where one of its turns went within `RESERVE_WINDOW_S`; one that has sent nothing there for
that long has its reservations there revoked and gets none until a turn of its goes there
again, so room does not sit with a dataplane that has stopped sending there. A reservation
is counted by a placeholder turn, placed, unconfirmed and interactive, so it takes room from
both classes and the replica's room is what it would be had a turn of either class been
placed there. The dataplane sends a turn of a run that last ran there straight to it and
reports the reservation used; the turn then takes its placeholder's place, and the decision
grants another if there is room.
A turn it cannot send on one (a run it does not know, another replica's) it admits the usual
way, giving back first, in the same message, its reservations on replicas serving the turn's
model; and while only its turns are held, one that its own dataplane holds a reservation for
where it may go (granted while the turn was on its way) takes that reservation's room, the
placement naming it: its own reservations never keep a dataplane's turns waiting.

Once a turn is held, every reservation is revoked (`Revoked`), and so is one on a replica
that turned unhealthy: it still counts until its dataplane gives it back or reports it used,
whichever its message says first, so room is never counted twice; the held turn is placed
when the room comes back. A dataplane's reservations end with its stream (`DataplaneLeft`)
or its resync, never by the turn timeout (a revoked one counts until given back), and one
whose replica leaves the pool is revoked as it goes.

Where a dataplane wants reservations is where its turns went: whatever places one of its
generative turns says so (`_sent_there`), and `_reserve`, at the end of the decision, reads
that, never the decision's actions.
"""

from __future__ import annotations

from immutables import Map

from luftpause.scheduler.actions import Action, Place, Reserved, Revoked
from luftpause.scheduler.core.place import _place, _room_of, _slot_for
from luftpause.scheduler.core.runs import _add_turn, _charge, _end_turn, _run_came_back, _set_run
from luftpause.scheduler.core.tx import (
    _BATCH,
    _GENERATIVE,
    _HELD,
    _INTERACTIVE,
    _PLACED,
    _group,
    _tracks_run,
    _Tx,
)
from luftpause.scheduler.events import (
    DataplaneLeft,
    ReservationReturned,
    ReservationsWanted,
    ReservationUsed,
)
from luftpause.scheduler.state import (
    RESERVED_CALLER,
    Replica,
    Reservation,
    Turn,
)

# A dataplane that sent no turn to a replica for this long holds no reservation there (`_reserve`).
RESERVE_WINDOW_S = 1.0


def _reserve(tx: _Tx, actions: list[Action], grant: bool = True) -> None:
    """Sets room aside for dataplanes while nothing is held, and takes it back when something is
    (the rules are this module's); `grant`: reservations may be granted in this decision."""
    held = bool(tx.held_groups)
    if held and not tx.reservations:
        return  # the usual case under load: nothing to revoke, nothing to grant
    if held and any(not r.revoked for r in tx.reservations.values()):
        _take_own_reservations(tx, actions)
        held = bool(tx.held_groups)
    _revoke(tx, actions, held)
    if held or not grant or not tx.reserving:
        return
    _grant(tx, actions)


def _revoke(tx: _Tx, actions: list[Action], held: bool) -> None:
    """Revokes every reservation while a turn is `held`, and otherwise those on a replica out of
    service or where their dataplane no longer wants them; one `Revoked` per dataplane."""
    revoke: dict[str, list[str]] = {}
    for reservation in tx.reservations.values():
        if not reservation.revoked and (
            held
            or not tx.replicas[reservation.replica].in_service
            or not _wants(tx, reservation.dataplane, reservation.replica)
        ):
            revoke.setdefault(reservation.dataplane, []).append(reservation.reservation_id)
    for dataplane in sorted(revoke):
        ids = sorted(revoke[dataplane])
        for reservation_id in ids:
            tx.reservations = tx.reservations.set(
                reservation_id, tx.reservations[reservation_id]._replace(revoked=True)
            )
        actions.append(Revoked(dataplane, tuple(ids)))


def _grant(tx: _Tx, actions: list[Action]) -> None:
    """Grants reservations where dataplanes want them and there is room (nothing is held)."""
    # Per dataplane, the replicas where it wants room.
    wanting = [
        (dataplane, {name for name in sent if _wants(tx, dataplane, name)})
        for dataplane, sent in sorted(tx.reserving.items())
    ]
    have: dict[tuple[str, str], int] = {}
    for r in tx.reservations.values():
        have[(r.dataplane, r.replica)] = have.get((r.dataplane, r.replica), 0) + 1
    # Where several dataplanes want room, a turn's worth is left free for whichever asks.
    contested: set[str] = set()
    seen: set[str] = set()
    for _, wanted in wanting:
        contested |= seen & wanted
        seen |= wanted
    # In rounds, one reservation per dataplane and replica each, while there is room: dataplanes
    # share a replica's room, and none holds more than its lookahead (one where it is uncapped).
    granted = True
    while granted:
        granted = False
        for dataplane, wanted in wanting:
            for name in tx.order:
                if name not in wanted:
                    continue
                replica = tx.replicas[name]
                if (
                    have.get((dataplane, name), 0) >= max(replica.lookahead, 1)
                    or not _room_of(tx, replica, 1 if name in contested else 0)[1]
                ):
                    continue
                actions.append(_grant_one(tx, dataplane, replica))
                have[(dataplane, name)] = have.get((dataplane, name), 0) + 1
                granted = True


def _grant_one(tx: _Tx, dataplane: str, replica: Replica) -> Reserved:
    """A reservation on `replica` for `dataplane`, counted by its placeholder turn: placed there,
    unconfirmed and interactive."""
    name = replica.name
    reservation_id = f"reservation-{tx.next_seq}"
    _add_turn(
        tx,
        Turn(
            reservation_id, "", _INTERACTIVE, RESERVED_CALLER, "", _GENERATIVE, tx.now, tx.next_seq,
            _PLACED, name, tx.now, dataplane=dataplane,
        ),
    )  # fmt: skip
    tx.next_seq += 1
    tx.reservations = tx.reservations.set(reservation_id, Reservation(reservation_id, dataplane, name))
    return Reserved(reservation_id, dataplane, name, replica.url, tuple(sorted(replica.models)))


def _take_own_reservations(tx: _Tx, actions: list[Action]) -> None:
    """While the turns held are all one dataplane's, those it holds a reservation (not revoked)
    for where they may go are placed on its room, in drain order (see `_reserve`): no other
    dataplane's turn waits for that room."""
    held = [t for t in tx.turns.values() if t.status is _HELD]
    if len({t.dataplane for t in held}) != 1:
        return
    for turn in sorted(held, key=lambda t: (t.service_class is _BATCH, t.seq)):
        group = _group(tx, turn)
        serving = tx.serving.get((turn.kind, turn.model), ())
        for reservation in tx.reservations.values():
            if (
                reservation.dataplane == turn.dataplane
                and not reservation.revoked
                and reservation.replica in serving
                and (group.pin is None or group.pin == reservation.replica)
                and tx.replicas[reservation.replica].in_service
            ):
                _end_turn(tx, reservation.reservation_id, tx.now, False, touch=False)
                replica = tx.replicas[reservation.replica]
                _place(tx, turn, group, replica)
                actions.append(
                    Place(turn.turn_id, turn.run_id, replica.name, replica.url, tx.now - turn.arrived_at,
                          reservation.reservation_id)
                )  # fmt: skip
                break


def _wants(tx: _Tx, dataplane: str, replica: str) -> bool:
    """Whether `dataplane` (taking reservations) sent a turn to `replica` within RESERVE_WINDOW_S."""
    sent = tx.reserving.get(dataplane)
    at = sent.get(replica) if sent is not None else None
    return at is not None and tx.now - at <= RESERVE_WINDOW_S


def _sent_there(tx: _Tx, dataplane: str, replica: str) -> None:
    """A turn of `dataplane` went to `replica` now: where it wants reservations, if it takes them."""
    sent = tx.reserving.get(dataplane)
    if sent is not None:
        tx.reserving = tx.reserving.set(dataplane, sent.set(replica, tx.now))


def _reservations_wanted(tx: _Tx, e: ReservationsWanted, actions: list[Action]) -> None:
    if e.dataplane not in tx.reserving:
        tx.reserving = tx.reserving.set(e.dataplane, Map())


def _reservation_used(tx: _Tx, e: ReservationUsed, actions: list[Action]) -> None:
    """The turn went to the reservation's replica without asking: its placeholder becomes the turn."""
    if e.reservation_id in tx.reservations:
        _end_turn(tx, e.reservation_id, e.at, False, touch=False)
    t = e.turn
    replica = tx.replicas.get(e.replica)
    if t.turn_id in tx.turns or replica is None:
        return  # already known (a duplicate report), or a replica no longer in the pool
    turn = Turn(
        t.turn_id, t.run_id, t.service_class, t.caller, t.model, t.kind, e.at, tx.next_seq,
        _PLACED, replica.name, tx.now, dataplane=t.dataplane, request_bytes=t.request_bytes,
        max_tokens=t.max_tokens,
    )  # fmt: skip
    tx.next_seq += 1
    _add_turn(tx, turn, _charge(tx, turn, tx.runs.get(turn.run_id) if _tracks_run(turn) else None))
    if _tracks_run(turn):
        _run_came_back(tx, t)
        run = tx.runs[turn.run_id]
        _set_run(tx, turn.run_id, run.placed_on(replica.name, tx.now, _slot_for(tx, run, replica)))
    _sent_there(tx, t.dataplane, replica.name)


def _reservation_returned(tx: _Tx, e: ReservationReturned, actions: list[Action]) -> None:
    if e.reservation_id in tx.reservations:
        _end_turn(tx, e.reservation_id, e.at, False, touch=False)


def _dataplane_left(tx: _Tx, e: DataplaneLeft, actions: list[Action]) -> None:
    if e.dataplane in tx.reserving:
        tx.reserving = tx.reserving.delete(e.dataplane)
    for reservation in list(tx.reservations.values()):
        if reservation.dataplane == e.dataplane:
            _end_turn(tx, reservation.reservation_id, e.at, False, touch=False)
