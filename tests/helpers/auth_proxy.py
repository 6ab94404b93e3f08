"""A real MLflow server behind HTTP basic auth, as a user's password-protected tracking server would be: `mlflow
server` on a free loopback port, and in front of it a stdlib proxy that answers 401 unless the request carries
`Authorization: Basic <user:password>`, then forwards it unchanged."""

from __future__ import annotations

import base64
import http.client
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

from vime_core.ports import free_port

HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "proxy-authorization", "authorization"}


def proxy_handler(upstream_port: int, user: str, password: str, seen: list[bool]):
    want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            seen.append(self.headers.get("Authorization") == want)
            if self.headers.get("Authorization") != want:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_HEADERS and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            conn.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        def log_message(self, *args) -> None:  # quiet
            pass

    return Handler


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"mlflow server on port {port} not ready after {timeout_s} s")


@contextmanager
def mlflow_behind_basic_auth(root: Path, user: str, password: str) -> Iterator[tuple[str, str, list[bool]]]:
    """(URI with the credentials, for the code under test; the server's own URI without auth, for the test to read
    back; one entry per request the proxy saw: whether it carried the right credentials)."""
    upstream = free_port()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(upstream),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'server.db'}",
            "--artifacts-destination",
            str(root / "server-artifacts"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: list[bool] = []
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), proxy_handler(upstream, user, password, seen))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_ready(upstream, proc)
        yield f"http://{user}:{password}@127.0.0.1:{server.server_port}", f"http://127.0.0.1:{upstream}", seen
    finally:
        server.shutdown()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
