"""A webhook receiver on 127.0.0.1 for alert tests: it records the JSON bodies it is sent."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vime_core.ports import free_port


def start_webhook() -> tuple[str, list[dict], ThreadingHTTPServer]:
    """-> (its URL, the bodies received so far (a live list), the server to shut down)."""
    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/hook", received, server
