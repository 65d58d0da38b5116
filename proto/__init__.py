"""The scheduler's gRPC contract (`scheduler.proto`) and its generated Python stubs."""

from luftpause import lifecycle
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as rpc

# The gRPC metadata key naming a dataplane where several share one scheduler (see scheduler.proto).
DATAPLANE_KEY = "x-luftpause-dataplane"
# The most items one DataplaneBatch may carry: the scheduler applies a message's items without
# yielding (some 0.1 ms an admit), so a bigger one ends the stream with RESOURCE_EXHAUSTED rather
# than stall every other stream and the status port; the dataplane splits what it sends to fit.
MAX_BATCH_ITEMS = 1024
# The service classes as the wire numbers them, by the names the class header and spawn give them
# (lifecycle.CLASSES), and back: the one map the dataplane and the scheduler translate with.
CLASS_BY_NAME: dict[str, "pb.ServiceClass"] = {
    lifecycle.INTERACTIVE: pb.INTERACTIVE,
    lifecycle.BATCH: pb.BATCH,
}
CLASS_NAMES: dict["pb.ServiceClass", str] = {number: name for name, number in CLASS_BY_NAME.items()}
# A run's phases (lifecycle.Phase) as the wire numbers them in a resync, and back.
PHASE_NUMBERS: dict[lifecycle.Phase, "pb.RunPhase"] = {
    lifecycle.Phase.IDLE: pb.IDLE,
    lifecycle.Phase.GENERATING: pb.GENERATING,
    lifecycle.Phase.PAUSED: pb.PAUSED,
}
PHASES: dict["pb.RunPhase", lifecycle.Phase] = {number: phase for phase, number in PHASE_NUMBERS.items()}

__all__ = [
    "CLASS_BY_NAME",
    "CLASS_NAMES",
    "DATAPLANE_KEY",
    "MAX_BATCH_ITEMS",
    "PHASES",
    "PHASE_NUMBERS",
    "pb",
    "rpc",
]
