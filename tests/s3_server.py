"""A real S3 server on loopback for the tests: moto's server mode behind a small TCP relay that can go down.

Nothing leaves the machine: moto listens on ``127.0.0.1`` (a free port), and the loader talks to it through
:class:`Relay` (another free port, ``S3_ENDPOINT_URL``). ``Relay.down()`` makes every new connection close at
once (the client sees the store gone) and drops the open ones; ``Relay.up()`` forwards again. The relay counts
what it turned away, so a test can show that the loader met the outage.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise

#: Credentials moto accepts (its authentication is off unless a test turns it on); never real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "zl-test-key-id", "AWS_SECRET_ACCESS_KEY": "zl-test-secret-6d1f0c",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Relay:
    """Forwards ``127.0.0.1:port`` to ``target``; :meth:`down` turns connections away until :meth:`up`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.refused = 0  # connections turned away while down
        self.forwarded = 0  # connections forwarded
        self._down = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="s3-relay", daemon=True).start()

    def down(self) -> None:
        self._down.set()
        with self._lock:
            for sock in list(self._open):
                _close(sock)
            self._open.clear()

    def up(self) -> None:
        self._down.clear()

    def close(self) -> None:
        self._closed = True
        self.down()
        _close(self.listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._down.is_set():
                self.refused += 1
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            self.forwarded += 1
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
                with self._lock:
                    self._open.discard(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class S3:
    """A moto S3 server and its relay; ``endpoint`` is what ``S3_ENDPOINT_URL`` names."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.moto_port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.server.start()
        self.relay = Relay(("127.0.0.1", self.moto_port))
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.moto_port}", region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file of ``folder`` to ``s3://bucket/prefix/<name>``; returns that prefix URL."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        self.relay.close()
        self.server.stop()


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` updated for the block, restored after (subprocesses started inside inherit it)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
