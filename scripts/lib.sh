# Helpers shared by scripts/bench, scripts/demo and scripts/soak (sourced, not run).

# free_port: a free loopback TCP port.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

# wait_until WHAT COMMAND...: retries COMMAND for up to 20 s, then stops the script with a message.
wait_until() {
  local what=$1; shift
  for _ in $(seq 200); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "scripts/$(basename "$0"): $what did not come up in 20 s" >&2; exit 1
}
