"""Protocol v2 over gRPC (the Open Inference Protocol's ``inference.GRPCInferenceService``): its
admission (a request message read only once the in-flight budget holds room for it), its wire
checks, its codec, its servicer (decode -> dataplane -> encode) and its server, beside the HTTP
routes of api/v2.

Imported only when ``grpc_port`` is set: it needs the ``service`` extra's grpcio,
grpcio-health-checking and tritonclient[grpc] (whose generated stubs it uses).
"""

from moegrad_service.api.grpc.server import GrpcServer

__all__ = ["GrpcServer"]
