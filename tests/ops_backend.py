"""A raw backend whose ``/v1/models`` answers whatever JSON it is given, and that counts.

Run as ``python -m tests.ops_backend --port P [--models-json TEXT] [--post-status N]
[--post-delay S]``.
``/health`` is always 200, so only the model listing can make the gateway doubt it. Every POST is
counted and answered with a small tokenize-like body; ``GET /counts`` says how many
POSTs and ``/v1/models`` requests arrived, so a test can see what the gateway
forwarded and how often it probed, instead of trusting its own account.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_LISTING = '{"object": "list", "data": [{"id": "Qwen/Qwen3-4B", "object": "model"}]}'


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posts = 0
        self.model_listings = 0


def handler(
    models_json: bytes, counts: Counts, post_status: int = 200, post_delay_s: float = 0.0
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real engines answer

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, b"{}")
            elif self.path == "/v1/models":
                with counts.lock:
                    counts.model_listings += 1
                self._answer(200, models_json)
            elif self.path == "/counts":
                with counts.lock:
                    body = {"posts": counts.posts, "model_listings": counts.model_listings}
                self._answer(200, json.dumps(body).encode())
            else:
                self._answer(404, b"{}")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            with counts.lock:
                counts.posts += 1
            time.sleep(post_delay_s)  # an engine slow to answer (counted on arrival)
            if post_status != 200:  # an engine that is up but fails every request
                self._answer(post_status, b'{"error": {"message": "engine failed"}}')
                return
            self._answer(200, b'{"count": 1, "max_model_len": 4096, "tokens": [1]}')

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per probe would bury the test's log

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--models-json", default=MODEL_LISTING)
    parser.add_argument("--post-status", type=int, default=200)
    parser.add_argument("--post-delay", type=float, default=0.0)
    args = parser.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port),
        handler(args.models_json.encode(), Counts(), args.post_status, args.post_delay),
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
