"""A real HTTP webhook receiver on 127.0.0.1 for tests: scripted statuses, Standard Webhooks verification."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks import Webhook

from services.telemetry.webhooks.ssrf import AllowList

LOOPBACK = AllowList.parse(["127.0.0.0/8"])


class Receiver:
    """Answers with the scripted statuses (then 200), verifying each request's signature with `secret`. A status
    may come with response headers: `(429, {"retry-after": "120"})`."""

    def __init__(self, statuses: list[int | tuple[int, dict[str, str]]], redirect_to: str | None = None):
        self.statuses = list(statuses)
        self.redirect_to = redirect_to
        self.secret: str | None = None
        self.requests: list[tuple[dict[str, str], bytes, bool]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    Webhook(receiver.secret or "").verify(body, headers, json_parse=False)
                    verified = True
                except Exception:
                    verified = False
                receiver.requests.append((headers, body, verified))
                scripted = receiver.statuses.pop(0) if receiver.statuses else 200
                status, extra = scripted if isinstance(scripted, tuple) else (scripted, {})
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                if 300 <= status < 400 and receiver.redirect_to:
                    self.send_header("location", receiver.redirect_to)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/gpuq?src=test"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
