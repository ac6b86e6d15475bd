"""``grpc.health.v1.Health`` on the picker's own gRPC server (h2_grpc): ``Check`` and ``Watch``.

Kubelet's gRPC probes and Envoy's gRPC health checker call ``Check``; clients with
client-side health checking (grpc-go, grpc-java) hold a ``Watch``. A service never set is
``NOT_FOUND`` to ``Check`` and ``SERVICE_UNKNOWN`` to ``Watch``, as gRPC's own servicer answers.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from .h2_grpc import INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, Handler, Stream

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"


class HealthBoard:
    """Each service's status, and the streams watching it."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.watchers: dict[str, set[Stream]] = {}

    def set(self, service: str, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        if self.status.get(service) == status:
            return
        self.status[service] = status
        answer = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        for stream in list(self.watchers.get(service, ())):
            stream.send(answer)

    def close_watches(self) -> None:
        """The server stops: each Watch ends (UNAVAILABLE) so its connection can close."""
        watchers, self.watchers = self.watchers, {}
        for streams in watchers.values():
            for stream in streams:
                stream.finish(UNAVAILABLE, "the server is stopping")

    def handlers(self) -> dict[str, Handler]:
        return {CHECK: lambda stream: _Check(self, stream), WATCH: lambda s: _Watch(self, s)}


class _Unary:
    """A call that reads one ``HealthCheckRequest``, answered once the client's side is done
    (``Check``) or at once (``Watch``)."""

    def __init__(self, board: HealthBoard, stream: Stream) -> None:
        self.board = board
        self.stream = stream
        self.service: str | None = None

    def on_message(self, message: bytes) -> None:
        if self.service is not None:
            self.stream.finish(INVALID_ARGUMENT, "one HealthCheckRequest per call")
            self.on_cancel()
            return
        try:
            self.service = health_pb2.HealthCheckRequest.FromString(message).service
        except DecodeError:
            self.stream.finish(INVALID_ARGUMENT, "not a HealthCheckRequest")
            return
        self.received()

    def received(self) -> None:
        pass

    def on_half_close(self) -> None:
        pass

    def on_cancel(self) -> None:
        pass


class _Check(_Unary):
    def on_half_close(self) -> None:
        status = self.board.status.get(self.service or "")
        if self.service is None:
            self.stream.finish(INVALID_ARGUMENT, "no HealthCheckRequest")
        elif status is None:
            self.stream.finish(NOT_FOUND, f"unknown service {self.service!r}")
        else:
            self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
            self.stream.finish()


class _Watch(_Unary):
    def received(self) -> None:
        service = self.service or ""
        status = self.board.status.get(service, SERVICE_UNKNOWN)
        self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.board.watchers.setdefault(service, set()).add(self.stream)

    def on_cancel(self) -> None:
        self.board.watchers.get(self.service or "", set()).discard(self.stream)
