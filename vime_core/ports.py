"""Sockets: a free port, and the trainer ranks' rendezvous store bound to one address. No vime_core imports: the
cluster, the converter, the trainer and the tests all stand above it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (the OS picks it; closed again before returning, so a caller that
    binds it later can in rare cases lose it to another process: the rendezvous then fails and names the port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_store(addr: str, port: int, rank: int, world: int, timeout):
    """The torch.distributed rendezvous store of the trainer ranks, listening on `addr` only (127.0.0.1 locally,
    the node's IP in a cluster): torch's own TCPStore server listens on every interface, and it has no
    authentication. Rank 0 hands torch a socket already bound to `addr`."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(max(128, world))
    return dist.TCPStore(addr, port, world, True, timeout, master_listen_fd=sock.detach())  # the store owns the fd
