"""The scheduler's gRPC contract (`scheduler.proto`) and its generated Python stubs."""

from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
