"""Starting the ratelimitd binary for the wire checks: on free loopback ports, with the environment given."""

import re
import subprocess
import threading
import time

# The listeners on loopback at free ports, in the reference's variables.
LOOPBACK = {"GRPC_HOST": "127.0.0.1", "GRPC_PORT": "0", "HOST": "127.0.0.1", "PORT": "0"}


def start(binary, env):
    """Runs `binary serve` with `env` (and LOOPBACK); returns the process and its gRPC address, read from its log."""
    proc = subprocess.Popen([binary, "serve"], env={**LOOPBACK, **env}, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    for line in proc.stderr:
        match = re.search(r"Listening for gRPC on '([^']+)'", line)
        if match:
            # Keep reading, so that the process never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, match.group(1)
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("ratelimitd did not start")
