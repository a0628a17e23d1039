"""Link test: does this host reach its peers over TCP on the training network, and do they reach it?

Run on every host of a hung job at once (`python -c SOURCE NONCE ARGS_JSON`, standard library
only): each host listens on one port and connects to its peers' listeners on it (every other
host, or ~log2(hosts) of them on a large run: diagnose/links.py), retrying until the window ends,
so one round tests those links in both directions without torch. The answer line
`DDPLAUNCH_ANSWER_<nonce> {...}` lists the peers this host reached and the addresses that reached
it. A host whose sshd answers but whose training traffic is dropped reaches nobody and is reached
by nobody, while the others reach each other.
"""

import json
import socket
import sys
import threading
import time


def serve(srv: socket.socket, came: set[str], deadline: float) -> None:
    """Accept connections until the deadline; note each peer address that connected."""
    while time.monotonic() < deadline:
        try:
            conn, (addr, _) = srv.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        came.add(addr)
        conn.close()


def reach(peer: str, port: int, deadline: float, reached: set[str]) -> None:
    """Connect to peer:port, retrying while its listener starts, until the deadline."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((peer, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                reached.add(peer)
                return
        except OSError:
            time.sleep(0.1)


def main(argv: list[str]) -> None:
    nonce, args = argv[0], json.loads(argv[1])
    port, peers, window = int(args["port"]), list(args["peers"]), float(args["window"])
    deadline = time.monotonic() + window
    answer = {"port": port, "reached": [], "came_from": [], "error": None}
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("", port))
        srv.listen(64)
        srv.settimeout(0.1)
    except OSError as err:
        answer["error"] = f"cannot listen on port {port}: {err}"
        print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps(answer), flush=True)
        return
    came: set[str] = set()
    reached: set[str] = set()
    server = threading.Thread(target=serve, args=(srv, came, deadline), daemon=True)
    server.start()
    callers = [threading.Thread(target=reach, args=(p, port, deadline, reached), daemon=True) for p in peers]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    # stay reachable for the hosts still trying, until every one that tests this host came or
    # the window ends
    expected = set()
    for peer in args.get("callers", peers):
        try:
            expected.add(socket.gethostbyname(peer))
        except OSError:
            expected.add(peer)
    while time.monotonic() < deadline and not expected <= came:
        time.sleep(0.05)
    srv.close()
    answer.update(reached=sorted(reached), came_from=sorted(came))
    print(f"DDPLAUNCH_ANSWER_{nonce} " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
