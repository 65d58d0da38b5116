"""One engine replica in virtual time: the fake engine's model, stepped on the simulator's clock.

A step's outcome is delivered at the step's end (first tokens, finished requests), exactly as the
HTTP fake engine delivers it after sleeping the step's duration; the next step starts then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from luftpause.bench.sim.clock import VirtualClock
from luftpause.fake_engine.engine import Engine, EngineLoad, EngineWork, ModelRequest, Step
from luftpause.fake_engine.params import EngineParams


@dataclass
class _Pending:
    on_first_token: Callable[[], None]
    on_done: Callable[[], None]
    started: bool = False


class SimReplica:
    def __init__(self, name: str, params: EngineParams, clock: VirtualClock) -> None:
        self.name = name
        self.engine = Engine(params)
        self._clock = clock
        self._pending: dict[str, _Pending] = {}
        self._stepping = False

    def submit(
        self, request: ModelRequest, on_first_token: Callable[[], None], on_done: Callable[[], None]
    ) -> None:
        self._pending[request.request_id] = _Pending(on_first_token, on_done)
        self.engine.submit(request)
        self._kick()

    def load(self) -> EngineLoad:
        return self.engine.load()

    def work(self) -> EngineWork:
        return self.engine.work()

    def _kick(self) -> None:
        if self._stepping or not self.engine.busy:
            return
        self.engine.idle_until(self._clock.now)
        step = self.engine.step()
        if step is None:
            return
        self._stepping = True
        self._clock.at(step.ended, lambda: self._deliver(step))

    def _deliver(self, step: Step) -> None:
        for request_id in step.tokens:
            pending = self._pending.get(request_id)
            if pending is not None and not pending.started:
                pending.started = True
                pending.on_first_token()
        for request_id in (*step.finished, *step.rejected):
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                pending.on_done()
        self._stepping = False
        self._kick()
