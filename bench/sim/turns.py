"""A turn as the simulator passes it between an agent, a placement policy and a replica."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from luftpause.fake_engine.engine import ModelRequest
from luftpause.fake_engine.replies import Reply
from luftpause.scheduler.state import ServiceClass


@dataclass
class SimTurn:
    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    index: int
    """0 for a run's first turn."""
    request: ModelRequest
    reply: Reply
    on_done: Callable[[SimTurn], None]
    replica: str | None = None
    arrived_at: float = 0.0
    first_token_at: float | None = None
    streamed: bool = True
    """A turn read whole tells the scheduler of its first token only as it ends."""
    tool_call_ids: tuple[str, ...] = field(default=())
    request_bytes: int = 0
    """The size of the request's JSON body, as a dataplane would see it (what the run gate
    estimates a run's first working set from)."""
