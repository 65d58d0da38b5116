"""The reservations the scheduler granted this dataplane on its current stream (`ReservationPool`).

While the scheduler holds no turn, it grants each dataplane that asks room on replicas ahead of
its turns (scheduler/core/reserve.py): a turn of a run this dataplane knows then goes to
its run's replica without asking, and the use rides to the scheduler with the next message. The
pool keeps them by replica, oldest first; the scheduler client decides when a turn may use one
and tells the scheduler what was used or given back. A new stream starts with an empty pool.
"""

from __future__ import annotations

from luftpause.proto import pb


class ReservationPool:
    """Granted reservations by replica, oldest first."""

    def __init__(self) -> None:
        self._by_replica: dict[str, list[pb.Reservation]] = {}
        # Some replica's are down to their last one (or none), and the scheduler has yet to hear it.
        self.running_low = False

    def __bool__(self) -> bool:
        return bool(self._by_replica)

    def clear(self) -> None:
        self._by_replica = {}

    def granted(self, reservations: list[pb.Reservation]) -> None:
        for reservation in reservations:
            self._by_replica.setdefault(reservation.replica, []).append(reservation)

    def take_for(self, replica: str, model: str) -> pb.Reservation | None:
        """The oldest reservation on `replica` if its replica serves `model`, taken out; None if none.

        Taking one that leaves the replica one or none sets `running_low`, so that the turn's
        next event goes at once and the scheduler, seeing the room again, grants more while the
        last one still serves the next turn."""
        pool = self._by_replica.get(replica)
        if not pool or model not in pool[0].models:
            return None
        reservation = pool.pop(0)
        self.running_low = len(pool) <= 1
        if not pool:
            del self._by_replica[replica]
        return reservation

    def take_out(self, ids: set[str]) -> list[pb.Reservation]:
        """Takes the reservations with these ids out; returns those it found."""
        found: list[pb.Reservation] = []
        for replica, pool in list(self._by_replica.items()):
            kept = [r for r in pool if r.id not in ids]
            if len(kept) != len(pool):
                found += [r for r in pool if r.id in ids]
                if kept:
                    self._by_replica[replica] = kept
                else:
                    del self._by_replica[replica]
        return found

    def take_serving(self, model: str) -> list[pb.Reservation]:
        """Takes out every reservation on a replica that serves `model` (to give them back)."""
        taken: list[pb.Reservation] = []
        for replica, pool in list(self._by_replica.items()):
            if model in pool[0].models:
                taken += self._by_replica.pop(replica)
        return taken
