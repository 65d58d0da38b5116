"""The scheduler's gRPC contract (`scheduler.proto`) and its generated Python stubs."""

from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as rpc

# The gRPC metadata key naming a dataplane where several share one scheduler (see scheduler.proto).
DATAPLANE_KEY = "x-luftpause-dataplane"

__all__ = ["DATAPLANE_KEY", "pb", "rpc"]
