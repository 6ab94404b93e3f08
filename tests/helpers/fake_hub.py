"""A minimal Hugging Face Hub on 127.0.0.1 serving one model repo from a local directory, so that
huggingface_hub's own `snapshot_download` fills a real hub cache (blobs, snapshots, refs) without network."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tree_listing(files: dict[str, Path]) -> list[dict]:
    """The hub's `/api/models/<repo>/tree/<rev>` answer: one entry per file."""
    return [
        {"type": "file", "path": n, "size": p.stat().st_size, "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
        for n, p in files.items()
    ]


def model_info(repo_id: str, files: dict[str, Path]) -> dict:
    """The hub's `/api/models/<repo>` answer at COMMIT."""
    siblings = [{"rfilename": n} for n in files]
    return {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": False, "siblings": siblings}


def serve(repo_id: str, folder: Path) -> tuple[ThreadingHTTPServer, str]:
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _file(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            prefix = f"/{repo_id}/resolve/"
            if not path.startswith(prefix):
                return self._json({"error": "not found"}, 404, head)
            _, _, name = path[len(prefix) :].partition("/")
            if name not in files:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                return
            data = files[name].read_bytes()
            etag = hashlib.sha256(data).hexdigest()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{etag}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _json(self, obj, code: int = 200, head: bool = False) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_HEAD(self):
            self._file(head=True)

        def do_GET(self):
            path = urlparse(self.path).path
            if path.startswith(f"/api/models/{repo_id}/tree/"):
                return self._json(tree_listing(files))
            if path.startswith(f"/api/models/{repo_id}"):
                return self._json(model_info(repo_id, files))
            self._file(head=False)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
