"""Wire compatibility: ratelimitd called with Envoy's own generated protos (PyPI xds-protos) and grpcio.

Starts the ratelimitd binary given as argv[1] on free loopback ports, sends requests built with the
official message types, and checks every field that Envoy reads. Prints `wire: N passed, M failed`.
"""

import os
import sys
import tempfile
import time

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import ratelimit_unit_pb2
from google.protobuf import wrappers_pb2

import ratelimitd  # beside this script

RULES = """
domain: wire
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2, name: per_user}
  - key: weekly
    rate_limit: {unit: week, requests_per_unit: 5}
"""

Response = rls_pb2.RateLimitResponse


def start(binary, rules_dir):
    return ratelimitd.start(binary, {"LIMIT_RESPONSE_HEADERS_ENABLED": "true", "RATELIMITD_RULES__PATH": rules_dir})


def descriptor(*entries, hits=None, override=None):
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
    )
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    if override is not None:
        d.limit.CopyFrom(
            ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(
                requests_per_unit=override[0], unit=override[1]
            )
        )
    return d


def checks(stub):
    def ask(*descriptors, hits_addend=0):
        return stub.ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain="wire", descriptors=descriptors, hits_addend=hits_addend),
            timeout=5,
        )

    def counting_and_status_fields():
        # The limit is a fixed window aligned to the minute: start well inside one, so the three calls share it.
        left = 60 - time.time() % 60
        if left < 5:
            time.sleep(left + 0.1)
        r = ask(descriptor(("user", "a")))
        assert r.overall_code == Response.OK, r
        s = r.statuses[0]
        assert s.code == Response.OK
        assert s.current_limit.requests_per_unit == 2
        assert s.current_limit.unit == Response.RateLimit.MINUTE
        assert s.current_limit.name == "per_user"
        assert s.limit_remaining == 1
        assert 1 <= s.duration_until_reset.seconds <= 60
        r = ask(descriptor(("user", "a")))
        r = ask(descriptor(("user", "a")))
        assert r.overall_code == Response.OVER_LIMIT
        assert r.statuses[0].code == Response.OVER_LIMIT
        assert r.statuses[0].limit_remaining == 0

    def descriptor_hits_addend_presence():
        # Present and 0: checks without counting; request-level addend ignored for it.
        for _ in range(3):
            r = ask(descriptor(("user", "b"), hits=0), hits_addend=5)
            assert r.overall_code == Response.OK and r.statuses[0].limit_remaining == 2, r
        r = ask(descriptor(("user", "b"), hits=2))
        assert r.statuses[0].limit_remaining == 0, r

    def override_with_unit():
        r = ask(descriptor(("anything", "x"), override=(7, ratelimit_unit_pb2.DAY)))
        limit = r.statuses[0].current_limit
        assert (limit.requests_per_unit, limit.unit) == (7, Response.RateLimit.DAY), r
        assert limit.name == ""

    def week_unit_is_seven():
        r = ask(descriptor(("weekly", "w")))
        assert r.statuses[0].current_limit.unit == Response.RateLimit.WEEK == 7, r

    def response_headers_to_add():
        r = ask(descriptor(("user", "c")))
        headers = [(h.key, h.value) for h in r.response_headers_to_add]
        assert [k for k, _ in headers] == ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"], headers
        assert headers[0][1] == "2" and headers[1][1] == "1", headers

    def errors_are_grpc_statuses():
        try:
            stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain="", descriptors=[descriptor(("u", "v"))]))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert err.details() == "rate limit domain must not be empty", err.details()
        else:
            raise AssertionError("empty domain accepted")

    return [
        counting_and_status_fields,
        descriptor_hits_addend_presence,
        override_with_unit,
        week_unit_is_seven,
        response_headers_to_add,
        errors_are_grpc_statuses,
    ]


def main():
    binary = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as rules_dir:
        with open(os.path.join(rules_dir, "wire.yaml"), "w") as f:
            f.write(RULES)
        proc, addr = start(binary, rules_dir)
        passed = failed = 0
        try:
            with grpc.insecure_channel(addr) as channel:
                stub = rls_pb2_grpc.RateLimitServiceStub(channel)
                for check in checks(stub):
                    try:
                        check()
                        passed += 1
                        print(f"ok   {check.__name__}")
                    except Exception as err:  # report every check, then fail
                        failed += 1
                        print(f"FAIL {check.__name__}: {err!r}")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    print(f"wire: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
