"""The README's first command and its examples, run as written: prints `readme: N passed, M failed`.

Reads README.md itself: runs the first ```sh block under "## Two commands" from the repository root (it
builds a release binary, which takes minutes the first time) in its own process group, waits for
/healthcheck on 127.0.0.1:8080, then sends the requests of "## Asking it": the curl command six times (the
first five OK with HTTP 200, the sixth OVER_LIMIT with HTTP 429; the first answer shaped as the README's
sample) and the grpcurl command's JSON over real gRPC with Envoy's generated protos (OVER_LIMIT: the same
counter, already spent). The service's whole process group is stopped whatever happens. Exits 1 on a failure
or when port 8080 or 8081 is already taken.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import json_format

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, ".."))
from tally import Tally  # noqa: E402

HEALTH_URL = "http://127.0.0.1:8080/healthcheck"
# The first run compiles a release build on whatever cores are free.
START_WITHIN_S = 40 * 60
Response = rls_pb2.RateLimitResponse

tally = Tally("readme")


def check(what, ok, detail=""):
    if ok:
        print(f"ok   {what}")
    tally(what, ok, detail)
    return ok


def section(readme, heading):
    """The text under `## heading`, up to the next `## `."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if not match:
        sys.exit(f"check_readme: README.md has no '## {heading}' section")
    return match.group(1)


def blocks(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def block_starting(text, lang, word):
    for block in blocks(text, lang):
        if block.lstrip().startswith(word):
            return block
    sys.exit(f"check_readme: no ```{lang} block starting with {word!r} in the README section")


def port_taken(port):
    """Whether 0.0.0.0:port cannot be bound, as the service will bind it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def healthy():
    try:
        with urllib.request.urlopen(HEALTH_URL, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def tail(path, lines=40):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def stop(proc):
    """Stops the whole process group (cargo and the service it started): SIGTERM, then SIGKILL."""
    if proc.poll() is None or group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.time() + 30
        while group_alive(proc.pid) and time.time() < deadline:
            proc.poll()
            time.sleep(0.2)
        if group_alive(proc.pid):
            print("the service did not stop on SIGTERM within 30 s: SIGKILL")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
    print(f"stopped the process group {proc.pid} (cargo and ratelimitd)")


def group_alive(pgid):
    """Whether a process of the group still runs (zombies waiting to be reaped do not count)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def curl(argv):
    """Sends the README's curl request; returns (HTTP status, body)."""
    if shutil.which("curl"):
        out = subprocess.run(argv + ["-w", "\n%{http_code}"], capture_output=True, text=True, timeout=30)
        body, _, code = out.stdout.rpartition("\n")
        return int(code or 0), body
    # No curl here: the same request (curl -d sends a form content type) with urllib.
    url = next(a for a in argv[1:] if "/json" in a)
    data = argv[argv.index("-d") + 1].encode()
    request = urllib.request.Request(
        url if "://" in url else "http://" + url,
        data=data,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def comparable(answer):
    """An answer with the values that depend on the time of the request taken out."""
    answer = json.loads(json.dumps(answer))
    for header in answer.get("responseHeadersToAdd", []):
        if header.get("key") == "RateLimit-Reset":
            header["value"] = "<seconds>"
    for status in answer.get("statuses", []):
        if "durationUntilReset" in status:
            status["durationUntilReset"] = "<seconds>"
    return answer


def ask(readme_section):
    curl_argv = shlex.split(block_starting(readme_section, "sh", "curl"))
    grpcurl_argv = shlex.split(block_starting(readme_section, "sh", "grpcurl"))
    sample = json.loads(blocks(readme_section, "json")[0])
    curl_payload = curl_argv[curl_argv.index("-d") + 1]
    grpc_payload = grpcurl_argv[grpcurl_argv.index("-d") + 1]
    address = next(a for a in grpcurl_argv if re.fullmatch(r"[\w.\-]+:\d+", a))
    method = grpcurl_argv[-1]
    print(f"curl request (README): {shlex.join(curl_argv)}")
    print(f"grpcurl request (README): {grpc_payload!r} to {address} {method}")
    check(
        "the curl and grpcurl examples send the same request",
        json_format.Parse(curl_payload, rls_pb2.RateLimitRequest())
        == json_format.Parse(grpc_payload, rls_pb2.RateLimitRequest()),
        f"{curl_payload} vs {grpc_payload}",
    )

    # The limit is per minute, aligned to the clock: six requests must land in one window.
    left = 60 - time.time() % 60
    if left < 10:
        print(f"{left:.1f} s left in this minute's window: waiting for the next one")
        time.sleep(left + 0.5)
    for attempt in range(1, 7):
        status, body = curl(curl_argv)
        try:
            answer = json.loads(body)
        except ValueError:
            answer = {}
        code = answer.get("overallCode")
        if attempt <= 5:
            check(f"curl attempt {attempt}: HTTP 200, overallCode OK", (status, code) == (200, "OK"), f"{status} {body}")
            remaining = answer.get("statuses", [{}])[0].get("limitRemaining", 0)
            check(f"curl attempt {attempt}: {5 - attempt} left", remaining == 5 - attempt, body)
        else:
            check("curl attempt 6: HTTP 429, overallCode OVER_LIMIT", (status, code) == (429, "OVER_LIMIT"), f"{status} {body}")
        if attempt == 1:
            check(
                "the first answer is the README's sample (times aside)",
                comparable(answer) == comparable(sample),
                f"\n  README: {json.dumps(sample)}\n  served: {body}",
            )

    check(
        "grpcurl's method is the rate limit service",
        method == "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        method,
    )
    request = json_format.Parse(grpc_payload, rls_pb2.RateLimitRequest())
    with grpc.insecure_channel(address) as channel:
        try:
            response = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=10)
            check(
                "grpcurl's request over gRPC (Envoy's protos): OVER_LIMIT, the same counter",
                response.overall_code == Response.OVER_LIMIT,
                str(response),
            )
        except grpc.RpcError as err:
            check("grpcurl's request over gRPC answers", False, f"{err.code()}: {err.details()}")


def wait_healthy(proc, log_path):
    """Waits for /healthcheck while the command builds and starts; whether it answered."""
    started = time.time()
    next_note = started + 60
    while not healthy():
        if proc.poll() is not None:
            return check("the run command starts the service", False,
                         f"it exited with {proc.returncode}:\n{tail(log_path)}")
        if time.time() - started > START_WITHIN_S:
            return check("the run command starts the service", False,
                         f"no /healthcheck within {START_WITHIN_S} s:\n{tail(log_path)}")
        if time.time() > next_note:
            print(f"... still building or starting ({time.time() - started:.0f} s)")
            next_note += 60
        time.sleep(0.5)
    return check(f"the run command serves /healthcheck on 127.0.0.1:8080 ({time.time() - started:.0f} s)", True)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    run_command = blocks(section(readme, "Two commands"), "sh")[0].strip()
    print(f"run command (README): {run_command}")
    for port in (8080, 8081):
        if port_taken(port):
            sys.exit(
                f"check_readme: port {port} is already in use; the README's command listens on 8080 (HTTP) "
                "and 8081 (gRPC): stop whatever holds it and run again"
            )

    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "service.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                run_command, shell=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            if wait_healthy(proc, log_path):
                ask(section(readme, "Asking it"))
                if tally.failed:
                    print(f"service log (tail):\n{tail(log_path)}")
        finally:
            stop(proc)
    return tally.finish()


if __name__ == "__main__":
    sys.exit(main())
