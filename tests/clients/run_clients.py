"""The example clients against a live ratelimitd: prints `clients: N passed, M failed`, exits 1 on a failure.

Starts the binary given as argv[1] with a rule of 3 per minute, generates the Python stubs from proto/ with
grpcio-tools, and runs examples/clients/python and examples/clients/node (its node_modules installed by
scripts/test with `npm ci`) as a service would: the first 3 calls answer OK, the 4th OVER_LIMIT.
"""

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "wire")]
from envoy_protos import start  # noqa: E402  (the wire check's way of starting the binary)
from tally import Tally  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTOS = [
    "envoy/service/ratelimit/v3/rls.proto",
    "envoy/config/core/v3/base.proto",
    "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
    "envoy/type/v3/ratelimit_unit.proto",
]
RULES = """
domain: clients
descriptors:
  - key: client
    # A sliding log counts the last 60 s whatever the clock says: the four calls (a second or so each, the
    # Python client starts an interpreter) never straddle a fixed window's boundary and see a fresh count.
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_client, algorithm: sliding_log}
"""

check = Tally("clients")


def calls(name, command, env=None):
    """Four calls for the same client: OK three times, then OVER_LIMIT."""
    for i in range(1, 5):
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
        first = out.stdout.splitlines()[0] if out.stdout else ""
        if i <= 3:
            check(f"{name} call {i} is OK", out.returncode == 0 and first == "OK", out.stdout + out.stderr)
        else:
            check(f"{name} call 4 is OVER_LIMIT", out.returncode == 1 and first == "OVER_LIMIT", out.stdout + out.stderr)
            check(f"{name} shows the limit", "3 per minute, 0 left" in out.stdout, out.stdout)


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as rules, tempfile.TemporaryDirectory() as stubs:
        with open(os.path.join(rules, "clients.yaml"), "w") as f:
            f.write(RULES)
        generated = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I", os.path.join(ROOT, "proto"),
             f"--python_out={stubs}", f"--grpc_python_out={stubs}", *PROTOS],
            capture_output=True, text=True,
        )
        check("Python stubs generate from proto/", generated.returncode == 0, generated.stderr)
        proc, address = start(binary, rules)
        try:
            env = dict(os.environ, PYTHONPATH=stubs)
            calls("python client", [sys.executable, os.path.join(ROOT, "examples/clients/python/ratelimit_client.py"),
                                    "--address", address, "--domain", "clients", "client=python"], env)
            calls("node client", ["node", os.path.join(ROOT, "examples/clients/node/client.js"),
                                  "--address", address, "--domain", "clients", "client=node"])
            # Fail open: nothing listening, the client lets the request through and says so.
            out = subprocess.run(
                ["node", os.path.join(ROOT, "examples/clients/node/client.js"), "--address", "127.0.0.1:9",
                 "--domain", "clients", "client=node"], capture_output=True, text=True, timeout=60)
            check("node client fails open", out.returncode == 0 and out.stdout.startswith("UNAVAILABLE"), out.stdout + out.stderr)
            out = subprocess.run(
                [sys.executable, os.path.join(ROOT, "examples/clients/python/ratelimit_client.py"),
                 "--address", "127.0.0.1:9", "--domain", "clients", "client=python"],
                capture_output=True, text=True, env=env, timeout=60)
            check("python client fails open", out.returncode == 0 and out.stdout.startswith("UNAVAILABLE"), out.stdout + out.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
