"""A local HTTP server that answers what `huggingface_hub` asks of the hub: a repository's
file tree (with each LFS file's sha256) and file downloads (HEAD, GET, ranges). No test
reaches the internet; point `huggingface_hub` at `url`."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0" * 40


class FakeHub:
    def __init__(
        self, repos: dict[str, dict[str, bytes]], *, gated: set[str] = frozenset()
    ) -> None:
        self.repos = repos
        self.gated = set(gated)
        self.corrupt: set[str] = set()  # files served with other bytes than listed
        self.requests: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []  # (file, start, end) of each range GET
        self.served = 0  # body bytes of file GETs, all told
        self.cut_after: int | None = None  # a file GET stops after this many body bytes
        self.garble_from: int | None = None  # file bytes from this offset on are sent as zeros
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                hub.requests.append(f"{self.command} {self.path}")

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                hub._answer(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        for repo, files in self.repos.items():
            if repo in self.gated and repo in path:
                return _send(h, 403, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"})
            if path.startswith(f"/api/models/{repo}/tree/"):
                tree = [
                    {
                        "type": "file",
                        "path": name,
                        "size": len(data),
                        "oid": hashlib.sha1(data).hexdigest(),
                        "lfs": {
                            "oid": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 130,
                        },
                    }
                    for name, data in files.items()
                ]
                return _send(
                    h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}
                )
            prefix = f"/{repo}/resolve/main/"
            if path.startswith(prefix) and path[len(prefix) :] in files:
                name = path[len(prefix) :]
                data = files[name]
                sha = hashlib.sha256(data).hexdigest()
                if name in self.corrupt:
                    data = bytes(len(data))
                if self.garble_from is not None:
                    data = data[: self.garble_from] + bytes(len(data) - self.garble_from)
                head = {
                    "X-Repo-Commit": COMMIT,
                    "ETag": f'"{sha}"',
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                    "Accept-Ranges": "bytes",
                }
                rng = h.headers.get("Range")
                if rng and h.command == "GET":
                    first, _, last = rng.split("=")[1].partition("-")
                    start, end = int(first), int(last or len(data) - 1) + 1
                    self.ranges.append((name, start, end))
                    head["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                    return self._send_file(h, 206, data[start:end], head)
                return self._send_file(h, 200, data, head)
        _send(h, 404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"})

    def _send_file(
        self, h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict[str, str]
    ) -> None:
        if h.command == "HEAD" or self.cut_after is None:
            if h.command != "HEAD":
                self.served += len(body)
            return _send(h, code, body, headers)
        # The server stops mid-response: headers promise the whole body, part of it comes.
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        part = body[: self.cut_after]
        h.wfile.write(part)
        self.served += len(part)
        h.wfile.flush()
        h.close_connection = True


def _send(h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict[str, str]) -> None:
    h.send_response(code)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)
