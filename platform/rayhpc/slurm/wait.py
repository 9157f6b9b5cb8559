"""Readiness checks for the sbatch startup: poll, never sleep a fixed time.

    python -m rayhpc.slurm.wait port HOST:PORT TIMEOUT          # the head's GCS accepts connections
    python -m rayhpc.slurm.wait nodes HOST:PORT TIMEOUT n1 n2   # every node has joined the cluster
"""

from __future__ import annotations

import socket
import sys
import time

POLL_S = 0.1


def wait_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray head at {host}:{port} did not open its port within {timeout_s:g} s") from None
            time.sleep(POLL_S)


def node_ip(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        return host


def wait_nodes(address: str, hosts: list[str], timeout_s: float) -> float:
    """Seconds until a Ray node is alive at each host's address; names the missing hosts otherwise."""
    import ray

    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        want = {host: node_ip(host) for host in hosts}
        while True:
            alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
            missing = [h for h, ip in want.items() if ip not in alive]
            if not missing:
                return time.monotonic() - started
            if time.monotonic() > deadline:
                joined = [h for h in hosts if h not in missing]
                raise TimeoutError(f"node(s) {', '.join(missing)} did not join the Ray cluster within {timeout_s:g} s "
                                   f"({len(joined)} of {len(hosts)} joined: {', '.join(joined) or 'none'})")
            time.sleep(POLL_S)
    finally:
        ray.shutdown()


def main(argv: list[str]) -> int:
    what, address, timeout = argv[0], argv[1], float(argv[2])
    host, port = address.rsplit(":", 1)
    try:
        if what == "port":
            wait_port(host, int(port), timeout)
        else:
            print(f"rayhpc: all {len(argv[3:])} node(s) joined in {wait_nodes(address, argv[3:], timeout):.1f} s",
                  flush=True)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
