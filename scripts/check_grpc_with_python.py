"""Checks that a running orchestrator coordinator or worker speaks standard gRPC to Python:
grpc.health.v1 health checks and server reflection (listing services and reading the
orchestrator.v1 descriptors), then calls Coordinator/Report through a dynamically built stub.

    pip install grpcio grpcio-health-checking grpcio-reflection
    python3 scripts/check_grpc_with_python.py 127.0.0.1:PORT [--report]
"""

import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


def main() -> int:
    addr = sys.argv[1]
    channel = grpc.insecure_channel(addr)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    print("health:", health_pb2.HealthCheckResponse.ServingStatus.Name(status))

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    services = [s.name for r in responses for s in r.list_services_response.service]
    print("services:", ", ".join(sorted(services)))
    ours = [s for s in services if s.startswith("orchestrator.v1.")]
    if not ours:
        print("no orchestrator.v1 service found")
        return 1

    pool = descriptor_pool.DescriptorPool()
    responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=ours[0])]), timeout=5)
    for r in responses:
        for raw in r.file_descriptor_response.file_descriptor_proto:
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            pool.Add(fd)
    for name in ours:
        service = pool.FindServiceByName(name)
        print(f"{name}: " + ", ".join(m.name for m in service.methods))

    if "--report" in sys.argv and "orchestrator.v1.Coordinator" in ours:
        req_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("orchestrator.v1.ClusterReportRequest"))
        resp_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("orchestrator.v1.ClusterReport"))
        call = channel.unary_unary(
            "/orchestrator.v1.Coordinator/Report", request_serializer=req_cls.SerializeToString, response_deserializer=resp_cls.FromString
        )
        report = call(req_cls(probe=False), timeout=60)
        print("report ok:", report.ok)
        print(report.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
