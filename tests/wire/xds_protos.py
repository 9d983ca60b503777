"""Wire compatibility of rules over xDS: the ratelimitd binary given as argv[1] against a control plane built
with Envoy's own generated discovery protos (PyPI xds-protos) and grpcio, independent of ratelimitd's own
proto subset. The RateLimitConfig payload is described here from envoyproxy/ratelimit's rls_conf.proto field
numbers (xds-protos does not carry it). Checks the subscription (node, metadata, type), the ACK, the NACK and
that the rules pushed are enforced. Prints `xds wire: N passed, M failed`.
"""

import os
import sys
import threading
from concurrent import futures

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ratelimitd  # noqa: E402  (beside this script)
from tally import Tally  # noqa: E402

TYPE_URL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"
check = Tally("xds wire")


def rate_limit_config_class():
    """RateLimitConfig, RateLimitDescriptor and RateLimitPolicy with the reference's field numbers."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="ratelimit/config/ratelimit/v3/rls_conf.proto",
        package="ratelimit.config.ratelimit.v3",
        syntax="proto3",
    )

    def message(name, fields):
        m = file.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            m.field.add(name=field_name, number=number, type=kind, label=label, type_name=type_name)

    one, many = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    prefix = ".ratelimit.config.ratelimit.v3."
    message("RateLimitConfig", [
        ("name", 1, f.TYPE_STRING, one, None),
        ("domain", 2, f.TYPE_STRING, one, None),
        ("descriptors", 3, f.TYPE_MESSAGE, many, prefix + "RateLimitDescriptor"),
    ])
    message("RateLimitDescriptor", [
        ("key", 1, f.TYPE_STRING, one, None),
        ("value", 2, f.TYPE_STRING, one, None),
        ("rate_limit", 3, f.TYPE_MESSAGE, one, prefix + "RateLimitPolicy"),
        ("descriptors", 4, f.TYPE_MESSAGE, many, prefix + "RateLimitDescriptor"),
        ("shadow_mode", 5, f.TYPE_BOOL, one, None),
    ])
    message("RateLimitPolicy", [
        ("unit", 1, f.TYPE_INT32, one, None),  # the RateLimitUnit enum on the wire
        ("requests_per_unit", 2, f.TYPE_UINT32, one, None),
        ("unlimited", 3, f.TYPE_BOOL, one, None),
        ("name", 4, f.TYPE_STRING, one, None),
    ])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("ratelimit.config.ratelimit.v3.RateLimitConfig"))


RateLimitConfig = rate_limit_config_class()
MINUTE, UNKNOWN = 2, 0


def config(name, domain, unit, limit):
    c = RateLimitConfig(name=name, domain=domain)
    d = c.descriptors.add(key="user")
    d.rate_limit.unit = unit
    d.rate_limit.requests_per_unit = limit
    d.rate_limit.name = "per_user"
    return any_pb2.Any(type_url=TYPE_URL, value=c.SerializeToString())


class ControlPlane(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Answers one stream: version 1 (valid), then version 2 (refused), keeping every request."""

    def __init__(self):
        self.seen = []
        self.arrived = threading.Condition()
        self.done = threading.Event()

    def _take(self, requests):
        request = next(requests)
        with self.arrived:
            self.seen.append(request)
            self.arrived.notify_all()
        return request

    def StreamAggregatedResources(self, requests, context):
        self._take(requests)
        yield discovery_pb2.DiscoveryResponse(
            version_info="1", type_url=TYPE_URL, nonce="a", resources=[config("api-route", "wire", MINUTE, 2)]
        )
        self._take(requests)
        yield discovery_pb2.DiscoveryResponse(
            version_info="2", type_url=TYPE_URL, nonce="b",
            resources=[config("api-route", "wire", MINUTE, 9), config("bad-route", "other", UNKNOWN, 9)],
        )
        self._take(requests)
        self.done.wait(30)

    def wait_for(self, count, within=20):
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.seen) >= count, within)


def start(binary, url):
    return ratelimitd.start(binary, {
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_SERVER_URL": url,
        "CONFIG_GRPC_XDS_NODE_ID": "wire-node",
        "CONFIG_GRPC_XDS_NODE_METADATA": "zone=eu-1",
    })


def main():
    plane = ControlPlane()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(plane, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proc, grpc_addr = start(sys.argv[1], f"127.0.0.1:{port}")
    try:
        check("three requests on the stream", plane.wait_for(3), f"{len(plane.seen)} seen")
        first, ack, nack = (plane.seen + [discovery_pb2.DiscoveryRequest()] * 3)[:3]
        check("subscription: node id", first.node.id == "wire-node", str(first.node))
        check("subscription: node metadata", first.node.metadata.fields["zone"].string_value == "eu-1", str(first.node))
        check("subscription: user agent", first.node.user_agent_name == "ratelimitd", str(first.node))
        check("subscription: type, every resource, no version or nonce",
              (first.type_url, list(first.resource_names), first.version_info, first.response_nonce)
              == (TYPE_URL, [], "", ""), str(first))
        check("ACK: version and nonce", (ack.version_info, ack.response_nonce) == ("1", "a")
              and not ack.HasField("error_detail"), str(ack))
        check("NACK: the version applied and the nonce refused", (nack.version_info, nack.response_nonce) == ("1", "b"), str(nack))
        check("NACK: the rules file's message, prefixed by the resource name",
              nack.error_detail.message == "bad-route: invalid rate limit unit 'UNKNOWN'", nack.error_detail.message)

        stub = rls_pb2_grpc.RateLimitServiceStub(grpc.insecure_channel(grpc_addr))
        entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value="w")
        answer = stub.ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain="wire", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])]),
            timeout=5,
        )
        limit = answer.statuses[0].current_limit
        check("the rules of version 1 are enforced, version 2 refused",
              (limit.requests_per_unit, limit.name) == (2, "per_user"), str(answer))
    finally:
        plane.done.set()
        proc.terminate()
        proc.wait(10)
        server.stop(0)
    sys.exit(check.finish())


if __name__ == "__main__":
    main()
