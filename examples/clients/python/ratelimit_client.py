"""Asking ratelimitd (or any Envoy rate limit service) from Python: a client a service can copy.

Stubs come from the repository's proto/ folder:

    pip install grpcio grpcio-tools
    python -m grpc_tools.protoc -I ../../../proto --python_out=. --grpc_python_out=. \
        envoy/service/ratelimit/v3/rls.proto envoy/config/core/v3/base.proto \
        envoy/extensions/common/ratelimit/v3/ratelimit.proto envoy/type/v3/ratelimit_unit.proto

Then, with ratelimitd running on the example rules:

    python ratelimit_client.py --domain edge remote_address=203.0.113.7 path=/login method=POST
"""

import argparse
import sys

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc


class RateLimiter:
    """One channel per process; one call per request to protect.

    `fail_open`: what to do when ratelimitd cannot answer within `timeout` seconds. True lets the request
    through (the usual choice: a limiter outage must not become an outage of the service); False refuses it.
    """

    def __init__(self, address, domain, timeout=0.05, fail_open=True):
        self.channel = grpc.insecure_channel(address)
        self.stub = rls_pb2_grpc.RateLimitServiceStub(self.channel)
        self.domain = domain
        self.timeout = timeout
        self.fail_open = fail_open

    def check(self, *descriptors, hits=1):
        """Each descriptor is a list of (key, value) pairs. Returns (allowed, response or None)."""
        request = rls_pb2.RateLimitRequest(
            domain=self.domain,
            hits_addend=hits,
            descriptors=[
                ratelimit_pb2.RateLimitDescriptor(
                    entries=[
                        ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries
                    ]
                )
                for entries in descriptors
            ],
        )
        try:
            response = self.stub.ShouldRateLimit(request, timeout=self.timeout)
        except grpc.RpcError as err:
            print(f"rate limit check failed ({err.code().name}): {err.details()}", file=sys.stderr)
            return self.fail_open, None
        return response.overall_code != rls_pb2.RateLimitResponse.OVER_LIMIT, response

    def close(self):
        self.channel.close()


def main():
    parser = argparse.ArgumentParser(description="Ask ratelimitd about one request.")
    parser.add_argument("--address", default="127.0.0.1:8081")
    parser.add_argument("--domain", default="edge")
    parser.add_argument("--hits", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=0.5, help="seconds")
    parser.add_argument("entries", nargs="+", help="key=value entries of one descriptor")
    args = parser.parse_args()

    limiter = RateLimiter(args.address, args.domain, timeout=args.timeout)
    entries = [tuple(e.split("=", 1)) for e in args.entries]
    allowed, response = limiter.check(entries, hits=args.hits)
    limiter.close()
    if response is None:
        print("UNAVAILABLE (allowed: fail open)" if allowed else "UNAVAILABLE (denied)")
        return 0 if allowed else 1
    code = rls_pb2.RateLimitResponse.Code.Name(response.overall_code)
    units = rls_pb2.RateLimitResponse.RateLimit.Unit
    print(code)
    for status in response.statuses:
        limit = status.current_limit
        if not status.HasField("current_limit"):
            print("  no limit applies")
            continue
        print(
            f"  {rls_pb2.RateLimitResponse.Code.Name(status.code)}:"
            f" {limit.requests_per_unit} per {units.Name(limit.unit).lower()},"
            f" {status.limit_remaining} left, reset in {status.duration_until_reset.seconds}s"
        )
    return 0 if allowed else 1


if __name__ == "__main__":
    sys.exit(main())
