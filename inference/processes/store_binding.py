"""The ranks' rendezvous and control stores listen on the interface the ranks need, not on every interface.

torch's `TCPStore` server listens on `::` (every interface, IPv4 included) whatever host it is given, and
torch's elastic agent creates two of them in the launching process (the c10d rendezvous and the ranks'
master store). They carry no secret, so on one node they belong on loopback, and across nodes on node 0's
`--master-addr` only (what the other nodes dial). `TCPStore` takes a socket already listening
(`master_listen_fd`): while `stores_listen_on(host)` is active, every store server created in this process
gets one bound to `host`, on the port it asked for (0: a free one).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from spd_lightning.errors import UserError

_lock = threading.Lock()
_AFTER_PORT = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd")


def listening_socket(host: str, port: int) -> int:
    """The file descriptor of a socket listening on `host:port`, handed over (the store closes it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port} for the ranks' rendezvous: {e.strerror or e}; on several nodes "
            "--master-addr must be an address of node 0 itself"
        ) from None
    return sock.detach()


@contextlib.contextmanager
def stores_listen_on(host: str) -> Iterator[None]:
    """Every `TCPStore` server created meanwhile (torch.distributed's and the elastic rendezvous modules' names
    for it) listens on `host` only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    original = dist.TCPStore

    def bound_store(host_name, port, *args, **kwargs):
        kwargs.update(zip(_AFTER_PORT, args))  # the static rendezvous passes is_master by position
        if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
            kwargs["master_listen_fd"] = listening_socket(host, port)
        return original(host_name, port, **kwargs)

    modules = (dist, c10d_rendezvous_backend, static_tcp_rendezvous)
    with _lock:
        for module in modules:
            module.TCPStore = bound_store
    try:
        yield
    finally:
        with _lock:
            for module in modules:
                module.TCPStore = original
