"""The scheduler's gRPC contract (`scheduler.proto`) and its generated Python stubs."""

from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as rpc

# The gRPC metadata key naming a dataplane where several share one scheduler (see scheduler.proto).
DATAPLANE_KEY = "x-luftpause-dataplane"
# The most items one DataplaneBatch may carry: the scheduler applies a message's items without
# yielding (some 0.1 ms an admit), so a bigger one ends the stream with RESOURCE_EXHAUSTED rather
# than stall every other stream and the status port; the dataplane splits what it sends to fit.
MAX_BATCH_ITEMS = 1024

__all__ = ["DATAPLANE_KEY", "MAX_BATCH_ITEMS", "pb", "rpc"]
