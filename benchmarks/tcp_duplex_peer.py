"""One end of benchmarks/tcp_duplex.sh: 8 MB one way, then 8 MB each way at once.

python tcp_duplex_peer.py server HOST          # in one namespace
python tcp_duplex_peer.py client HOST LABEL    # in the other: prints the two times
"""

from __future__ import annotations

import socket
import sys
import threading
import time

SIZE = 8 * 2**20
PORT = 7777


def send_all(sock: socket.socket, num_bytes: int) -> None:
    chunk = b"x" * 65536
    left = num_bytes
    while left > 0:
        left -= sock.send(chunk[: min(left, len(chunk))])


def recv_all(sock: socket.socket, num_bytes: int) -> None:
    left = num_bytes
    while left > 0:
        got = sock.recv(min(left, 1 << 20))
        if not got:
            raise EOFError("the peer closed the connection")
        left -= len(got)


def both_ways(sock: socket.socket) -> None:
    """Send SIZE on a thread while receiving SIZE: both directions at once."""
    sender = threading.Thread(target=send_all, args=(sock, SIZE))
    sender.start()
    recv_all(sock, SIZE)
    sender.join()


def serve(host: str) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, PORT))
    listener.listen(1)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    recv_all(conn, SIZE)  # one way: client → server
    conn.send(b"k")
    both_ways(conn)
    conn.recv(1)
    conn.close()


def connect(host: str) -> socket.socket:
    """The server's socket, retried for up to 5 s while it starts."""
    for _ in range(50):
        try:
            return socket.create_connection((host, PORT))
        except ConnectionRefusedError:
            time.sleep(0.1)
    return socket.create_connection((host, PORT))


def measure(host: str, label: str) -> None:
    conn = connect(host)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    started = time.perf_counter()
    send_all(conn, SIZE)
    recv_all(conn, 1)
    one_way = time.perf_counter() - started
    started = time.perf_counter()
    both_ways(conn)
    two_ways = time.perf_counter() - started
    conn.send(b"k")
    conn.close()
    print(
        f"{label}: one way {one_way:.2f} s, both ways {two_ways:.2f} s, "
        f"ratio {two_ways / one_way:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "server":
        serve(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "client":
        measure(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: tcp_duplex_peer.py server HOST | client HOST LABEL")
