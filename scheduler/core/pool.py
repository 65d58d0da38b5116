"""The replicas: a new pool configuration, a probe's reading, a turn's outcome counted toward
ejecting its replica (outliers.py), and a router's load summed from its engines'.
"""

from __future__ import annotations

from immutables import Map

from luftpause.errors import no_replica_serves
from luftpause.scheduler import outliers
from luftpause.scheduler.actions import Action, Refuse, Revoked
from luftpause.scheduler.core.confirm import _confirm_by_reading
from luftpause.scheduler.core.runs import _rebuild
from luftpause.scheduler.core.tx import _HELD, _PLACED, _Tx
from luftpause.scheduler.events import (
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
)
from luftpause.scheduler.state import (
    RESERVED_CALLER,
    Kind,
    Replica,
    Turn,
)


def refusal_message(kind: Kind, model: str) -> str:
    """What a client sees when no replica of `kind` serves `model` (404 at the dataplane)."""
    return no_replica_serves(kind.value, model)


def _pool_configured(tx: _Tx, e: PoolConfigured, actions: list[Action]) -> None:
    tx.may_place = True
    replicas: dict[str, Replica] = {}
    serving: dict[tuple[Kind, str], list[str]] = {}
    routers_of: dict[str, list[str]] = {}
    for spec in e.replicas:
        fresh = _replica(spec, tx.replicas.get(spec.name))
        replicas[spec.name] = fresh
        for model in spec.models:
            serving.setdefault((spec.kind, model), []).append(spec.name)
        for engine in spec.load_from:
            routers_of.setdefault(engine, []).append(spec.name)
    tx.replicas = Map(replicas)
    tx.order = tuple(s.name for s in e.replicas)
    tx.serving = Map({k: tuple(v) for k, v in serving.items()})
    tx.routers_of = Map({k: tuple(v) for k, v in routers_of.items()})
    for name in tx.order:
        if replicas[name].load_from:
            _refresh_router(tx, name)

    kept: list[Turn] = []
    gone: dict[str, list[str]] = {}
    for turn in sorted(tx.turns.values(), key=lambda t: t.seq):
        if turn.status is _PLACED and turn.replica not in replicas:
            reservation = tx.reservations.get(turn.turn_id)
            if reservation is not None and not reservation.revoked:
                gone.setdefault(reservation.dataplane, []).append(reservation.reservation_id)
            continue  # its replica left the pool: nothing to count it against
        if turn.status is _HELD and not tx.serving.get((turn.kind, turn.model)):
            actions.append(Refuse(turn.turn_id, turn.run_id, refusal_message(turn.kind, turn.model)))
            continue
        kept.append(turn)
    _rebuild(tx, list(tx.runs.values()), kept)
    # Its dataplane must not send a turn there on a reservation it still holds.
    actions.extend(Revoked(dataplane, tuple(ids)) for dataplane, ids in sorted(gone.items()))


def _replica(spec: ReplicaSpec, old: Replica | None) -> Replica:
    """The replica `spec` configures; `old`: the same replica as it stood before, if any."""
    fresh = Replica(
        name=spec.name,
        url=spec.url,
        kind=spec.kind,
        models=frozenset(spec.models),
        reports_load=spec.reports_load or bool(spec.load_from),
        load_from=spec.load_from,
        lookahead=spec.lookahead,
        kv_tokens=spec.kv_tokens,
        kv_configured=spec.kv_tokens is not None,
        gate_min_runs=spec.gate_min_runs,
        kv_slots=spec.kv_slots,
        slots_configured=spec.kv_slots is not None,
        host_cache=spec.host_cache,
        host_cache_source="config" if spec.host_cache_configured else "default",
        ejection_base_s=spec.ejection_base_s,
    )
    if old is not None:
        # A replica that stays in the pool keeps what its probes said.
        if old.host_cache_source == "engine" and fresh.host_cache_source != "config":
            fresh = fresh._replace(host_cache=old.host_cache, host_cache_source="engine")
        fresh = fresh._replace(
            healthy=old.healthy,
            probed=old.probed,
            running=old.running,
            waiting=old.waiting,
            others_waiting=old.others_waiting,
            read_at=old.read_at,
            kv_tokens=fresh.kv_tokens if fresh.kv_configured else old.kv_tokens,
            kv_slots=fresh.kv_slots if fresh.slots_configured else old.kv_slots,
            prompt_tokens=old.prompt_tokens,
            cached_tokens=old.cached_tokens,
            outlier=old.outlier,
        )
    return fresh


def _replica_probed(tx: _Tx, e: ReplicaProbed, actions: list[Action]) -> None:
    replica = tx.replicas.get(e.name)
    if replica is None:
        return
    tx.may_place = True
    if replica.load_from:
        # A router's own reading is not its engines' load: only its health counts.
        replica = replica._replace(healthy=e.healthy, probed=True)
    else:
        # A probe that could not read the load leaves the last reading standing: forgetting it
        # would uncap a queueing engine because of one lost /metrics answer.
        replica = replica._replace(
            healthy=e.healthy,
            probed=True,
            running=e.running if e.running is not None else replica.running,
            waiting=e.waiting if e.waiting is not None else replica.waiting,
        )
    if e.kv_tokens is not None and e.kv_tokens > 0 and not replica.kv_configured:
        replica = replica._replace(kv_tokens=e.kv_tokens)
    if e.kv_slots is not None and e.kv_slots > 0 and not replica.slots_configured:
        replica = replica._replace(kv_slots=e.kv_slots)
    if e.host_cache is not None and replica.host_cache_source != "config":
        # The engine's word on its host tier (gate.gated): the gate holds no runs where it keeps one.
        replica = replica._replace(host_cache=e.host_cache, host_cache_source="engine")
    if e.prompt_tokens is not None and e.cached_tokens is not None:
        replica = replica._replace(prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens)
    tx.replicas = tx.replicas.set(e.name, replica)
    sent_at = e.sent_at if e.sent_at is not None else e.at
    if replica.load_from:
        _refresh_router(tx, e.name)
    elif e.waiting is not None:
        _confirm_by_reading(tx, e.name, sent_at)
    for router in tx.routers_of.get(e.name, ()):
        _refresh_router(tx, router)
        _confirm_by_reading(tx, router, sent_at)


def _count_outcome(tx: _Tx, turn: Turn, failed: bool) -> None:
    """A placed turn ended on its replica, a success or a failure of the replica's own: counted
    toward ejecting it (outliers.py), which happens here unless it is the last in service."""
    if turn.status is not _PLACED or turn.replica is None or turn.caller == RESERVED_CALLER:
        return
    replica = tx.replicas.get(turn.replica)
    if replica is None:
        return
    record = outliers.turn_ended(replica.outlier, failed, tx.now)
    if failed and outliers.is_outlier(record) and _others_serve(tx, replica):
        record = outliers.eject(record, tx.now, replica.ejection_base_s)
        # The runs pinned there may go elsewhere now (`_choose`).
        tx.may_place = True
    tx.replicas = tx.replicas.set(replica.name, replica._replace(outlier=record))


def _others_serve(tx: _Tx, replica: Replica) -> bool:
    """Whether every model `replica` serves has another replica of its kind in service."""
    for model in replica.models:
        names = tx.serving.get((replica.kind, model), ())
        if not any(name != replica.name and tx.replicas[name].in_service for name in names):
            return False
    return True


def _refresh_router(tx: _Tx, name: str) -> None:
    """A router's load: the sums of its engines' last readings (None while none of them has one)."""
    router = tx.replicas[name]
    engines = [tx.replicas[n] for n in router.load_from if n in tx.replicas]
    running = [r.running for r in engines if r.running is not None]
    waiting = [r.waiting for r in engines if r.waiting is not None]
    router = router._replace(
        running=sum(running) if running else None, waiting=sum(waiting) if waiting else None
    )
    tx.replicas = tx.replicas.set(name, router)
