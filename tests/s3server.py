"""A real S3 API server for the tests: moto's server on 127.0.0.1 (a free port), reached through
s3fs with dummy credentials, and a TCP relay in front of it that a test can cut (the server then
looks stopped to every client) the moment a chosen request passes."""
from __future__ import annotations

import os
import socket
import threading
from contextlib import contextmanager
from typing import Optional

from adacheck.cli.local_ranks import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Relay:
    """Forwards TCP connections from its own port to the server's.  ``cut_on(marker)``: when a
    request whose first line holds ``marker`` (bytes, e.g. b"PUT /bucket/x/manifest.json") arrives,
    that request is dropped and the relay shuts: open connections are closed and new ones refused,
    as when the server goes away.  ``reopen()`` serves again.  ``received``: the bytes the server
    has sent back so far (responses, headers included)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.port = free_port()
        self.marker: Optional[bytes] = None
        self.cut = threading.Event()
        self.requests = []
        self.received = 0
        self._conns = []
        self._lock = threading.Lock()
        self._listen()

    def _listen(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        threading.Thread(target=self._accept, args=(self.sock,), daemon=True).start()

    def _accept(self, sock):
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return
            if self.cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src, dst, inspect):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if inspect:
                    first = data.split(b"\r\n", 1)[0]
                    if first.split(b" ")[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"):
                        self.requests.append(first)
                        if self.marker is not None and self.marker in first:
                            self.shut()
                            return
                else:
                    with self._lock:
                        self.received += len(data)
                if self.cut.is_set():
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut_on(self, marker: bytes) -> None:
        self.marker = marker

    def shut(self) -> None:
        self.cut.set()
        self.marker = None
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def reopen(self) -> None:
        self.cut.clear()
        self._listen()


class S3:
    """A running server: ``url(path)`` for ``s3://BUCKET/path``, ``options`` for AdaCheck's
    storage_options, ``env`` for processes that should reach it, ``fs`` an s3fs filesystem."""

    def __init__(self, server, relay: Relay, bucket: str):
        self.server, self.relay, self.bucket = server, relay, bucket
        self.endpoint = f"http://127.0.0.1:{relay.port}"
        # one attempt per request: a stopped server is an error at once, not minutes of retries
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                        "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"},
                                          "connect_timeout": 5, "read_timeout": 30}}
        self.env = dict(CREDENTIALS)
        import s3fs
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}".rstrip("/")

    def keys(self, prefix: str = ""):
        self.fs.invalidate_cache()
        return sorted(k.split("/", 1)[1] for k in self.fs.find(f"{self.bucket}/{prefix}"))


@contextmanager
def s3_server(bucket: str = "ckpt"):
    from moto.server import ThreadedMotoServer
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server.start()
    # moto keeps its buckets in this process's memory, shared by every server it starts here:
    # a server starts empty only once that state is reset
    import urllib.request
    urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/moto-api/reset", method="POST"), timeout=30).close()
    relay = Relay(port)
    try:
        s3 = S3(server, relay, bucket)
        s3.fs.mkdir(bucket)
        yield s3
    finally:
        relay.shut()
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
