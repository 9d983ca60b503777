"""Wire compatibility of the rate limit quota service: the ratelimitd binary given as argv[1], driven with
Envoy's own generated RLQS protos (PyPI xds-protos) and grpcio, independent of ratelimitd's own proto subset.

Opens a stream as Envoy's filter does (a bucket's first report alone, with no time elapsed, then a periodic
report), and checks every field Envoy reads in the answers: the bucket id echoed, a TTL in whole seconds of
several report periods, a token bucket with `tokens_per_fill` set and a whole-second fill interval, blanket
rules for unlimited and zero limits, and an abandon action once the bucket's rule is removed. Prints
`rlqs wire: N passed, M failed`.
"""

import os
import queue
import sys
import tempfile
import time

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.type.v3 import ratelimit_strategy_pb2
from google.protobuf import duration_pb2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ratelimitd  # noqa: E402  (beside this script)
from tally import Tally  # noqa: E402

RULES = """
domain: wire
descriptors:
  - key: generic_key
    value: shared
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: generic_key
    value: free
    rate_limit: {unlimited: true}
  - key: generic_key
    value: closed
    rate_limit: {unit: second, requests_per_unit: 0}
"""

# The same rules without `shared`: its bucket is then abandoned.
WITHOUT_SHARED = RULES.replace(
    """  - key: generic_key
    value: shared
    rate_limit: {unit: second, requests_per_unit: 100}
""",
    "",
)

Usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage
Strategy = ratelimit_strategy_pb2.RateLimitStrategy
check = Tally("rlqs wire")


def usage(value, elapsed, allowed, denied=0):
    return Usage(
        bucket_id=rlqs_pb2.BucketId(bucket={"generic_key": value}),
        time_elapsed=duration_pb2.Duration(seconds=elapsed),
        num_requests_allowed=allowed,
        num_requests_denied=denied,
    )


class Stream:
    """One stream, reports in through a queue, answers read by bucket value."""

    def __init__(self, stub):
        self.outbound = queue.Queue()
        self.responses = stub.StreamRateLimitQuotas(iter(self.outbound.get, None), timeout=60)

    def report(self, *usages):
        self.outbound.put(rlqs_pb2.RateLimitQuotaUsageReports(domain="wire", bucket_quota_usages=usages))

    def actions(self, count):
        """The next `count` bucket actions, by the value of their bucket's generic_key."""
        got = {}
        while len(got) < count:
            for action in next(self.responses).bucket_action:
                got[action.bucket_id.bucket["generic_key"]] = action
        return got

    def close(self):
        self.outbound.put(None)


def assignment(action, name):
    kind = action.WhichOneof("bucket_action")
    check(f"{name}: a quota assignment", kind == "quota_assignment_action", str(kind))
    assign = action.quota_assignment_action
    ttl = assign.assignment_time_to_live
    check(f"{name}: TTL in whole seconds, several report periods", ttl.nanos == 0 and ttl.seconds >= 10, str(ttl))
    return assign.rate_limit_strategy


def main():
    binary = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as rules_dir:
        rules = os.path.join(rules_dir, "wire.yaml")
        with open(rules, "w") as f:
            f.write(RULES)
        proc, addr = ratelimitd.start(binary, {"RATELIMITD_RULES__PATH": rules_dir})
        try:
            with grpc.insecure_channel(addr) as channel:
                stream = Stream(rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel))
                # Each bucket's first report, as Envoy sends it: alone, one request, no time elapsed.
                stream.report(usage("shared", 0, 1))
                shared = assignment(stream.actions(1)["shared"], "subscription")
                check("subscription: a token bucket", shared.WhichOneof("strategy") == "token_bucket", str(shared))
                bucket = shared.token_bucket
                check("token bucket: tokens_per_fill set", bucket.HasField("tokens_per_fill"), str(bucket))
                interval = bucket.fill_interval
                check("token bucket: whole-second fill interval", interval.seconds >= 1 and interval.nanos == 0,
                      str(interval))
                rate = bucket.tokens_per_fill.value / max(interval.seconds, 1)
                check("token bucket: alone, the whole limit and no more", 90 <= rate <= 100, str(bucket))
                check("token bucket: a burst of at least one token", bucket.max_tokens >= 1, str(bucket))

                stream.report(usage("free", 0, 1), usage("closed", 0, 1))
                got = stream.actions(2)
                free, closed = assignment(got["free"], "unlimited"), assignment(got["closed"], "zero limit")
                check("unlimited: ALLOW_ALL", free.WhichOneof("strategy") == "blanket_rule"
                      and free.blanket_rule == Strategy.ALLOW_ALL, str(free))
                check("zero limit: DENY_ALL", closed.WhichOneof("strategy") == "blanket_rule"
                      and closed.blanket_rule == Strategy.DENY_ALL, str(closed))

                # A periodic report extends the assignment with the same token bucket.
                stream.report(usage("shared", 1, 40, 2))
                again = assignment(stream.actions(1)["shared"], "report")
                check("report: the same token bucket again", again == shared, f"{again} != {shared}")

                # The rule removed: the bucket is abandoned at its next report.
                with open(rules, "w") as f:
                    f.write(WITHOUT_SHARED)
                deadline, kind = time.time() + 20, None
                while time.time() < deadline and kind != "abandon_action":
                    time.sleep(0.5)
                    stream.report(usage("shared", 1, 1))
                    kind = stream.actions(1)["shared"].WhichOneof("bucket_action")
                check("removed rule: abandon_action", kind == "abandon_action", str(kind))
                stream.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    sys.exit(check.finish())


if __name__ == "__main__":
    main()
