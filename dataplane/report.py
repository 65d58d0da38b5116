"""What happened to a turn, told to the scheduler and left behind for an operator, at once.

The proxy says when a turn's engine request goes out, when its first token arrives, and how it
ended (`TurnReport`); each is reported on the scheduler stream (`SchedulerClient`) and observed
in the turn's span and metrics (`TurnObserver`), so that the scheduler and the operator never
hear of different endings. A turn ends once: whichever of `failed` and `ended` comes first
counts, and a later one changes nothing.
"""

from __future__ import annotations

import logging
import time

from luftpause import logs
from luftpause.dataplane.observe import TurnObserver
from luftpause.dataplane.scheduler_client import SchedulerClient
from luftpause.dataplane.sse import ReplyObservation
from luftpause.dataplane.turn import ProxiedTurn

log = logging.getLogger(__name__)

# The most of a failed turn's error text the scheduler is told.
MAX_ERROR_CHARS = 1000
# How often a warning that a replica may cause on every turn is logged, at most (per replica).
WARN_EVERY_S = 60.0


class TurnReport:
    """The reports of every turn through one dataplane: to `scheduler`, and to `observe`."""

    def __init__(self, scheduler: SchedulerClient, observe: TurnObserver) -> None:
        self.scheduler = scheduler
        self.observe = observe
        self._now_and_then = logs.NowAndThen(WARN_EVERY_S)

    def started(self, turn: ProxiedTurn) -> None:
        """The engine request goes out now."""
        self.scheduler.started(turn.id, turn.scheduler_run_id, turn.streamed)
        turn.sent_at = time.perf_counter()

    def first_token(self, turn: ProxiedTurn) -> None:
        """The engine's first token reached us (once a turn, streamed or not)."""
        if turn.first_token_seen:
            return
        turn.first_token_seen = True
        self.observe.first_token(turn, time.perf_counter() - turn.sent_at)
        self.scheduler.first_token(turn.id, turn.scheduler_run_id)

    def failed(self, turn: ProxiedTurn, error: str, replica_fault: bool = False) -> None:
        """The turn ended in `error`; `replica_fault`: the replica's doing (it could not be reached,
        broke off, sent what is not a reply, or answered 5xx), which counts toward ejecting it
        (scheduler/outliers.py), unlike a client that left or a request the engine refused."""
        if not turn.ended:
            turn.ended = True
            # The error may quote the engine: any text, any length; the report carries it readable and bounded.
            error = error[:MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")
            self.observe.failed(turn, error)
            self.scheduler.failed(turn.id, turn.scheduler_run_id, error, replica_fault)

    def ended(self, turn: ProxiedTurn, observation: ReplyObservation) -> None:
        """A reply that came back whole: completed (its first token first, if not told yet), or
        failed when the engine said it failed.

        A usage out of range (`luftpause.counts`) is reported as none (the scheduler then sizes
        the run as before its usage was known) and logged once a minute per replica.
        """
        if observation.error:
            self.observe.engine_error(turn, "reply_error")
            self.failed(turn, f"engine {turn.replica}: {observation.error}")
            return
        if observation.unreadable:
            self.observe.engine_error(turn, "unreadable")
            self.failed(turn, f"engine {turn.replica}: {observation.unreadable}", replica_fault=True)
            return
        if observation.bad_usage and self._now_and_then.due(("usage", turn.replica)):
            log.warning(
                "engine %s sent a usage out of range (%s); counted as no usage (logged once a minute per replica)",
                turn.replica,
                observation.bad_usage,
            )
        if turn.ended or not self._completed(turn, observation):
            return
        if not turn.ended:
            turn.ended = True
            self.observe.completed(turn, observation)

    def _completed(self, turn: ProxiedTurn, observation: ReplyObservation) -> bool:
        """Reports the turn completed; False when that report cannot be made (something in the
        reply no message can carry): the turn is then reported failed instead, so that its slot
        is freed now and not at the turn timeout."""
        try:
            if observation.first_token:
                self.first_token(turn)
            self.scheduler.completed(
                turn.id,
                turn.scheduler_run_id,
                observation.finish_reason,
                observation.prompt_tokens,
                observation.completion_tokens,
                observation.tool_call_ids,
                observation.tool_names,
            )
        except Exception as error:
            if self._now_and_then.due(("report", turn.replica)):
                log.warning(
                    "turn %s on %s: its completion could not be reported (%r); reported failed instead "
                    "(logged once a minute per replica)",
                    turn.id,
                    turn.replica,
                    error,
                )
            self.failed(
                turn, f"engine {turn.replica}: its reply could not be reported: {type(error).__name__}"
            )
            return False
        return True
