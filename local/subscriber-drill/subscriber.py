"""The subscriber of `./scripts/subscriber-drill`, having a bad day.

It answers 500 to the first try of every fifth event (chosen by a digest of its webhook-id),
and after its 60th accepted delivery it is down, refusing connections, for DOWN_SECONDS (10).
Every request is verified with the Standard Webhooks reference library (PyPI standardwebhooks),
not with the receiver's code, and logged to the file named by the first argument as a JSON
line: webhook-id, the envelope's type, whether it verified, the status answered.

Usage: subscriber.py LOG  (PORT, default 9099; DOWN_SECONDS). The signing secret is
local/subscriber's, read from local/secrets.toml as the local runner reads it.
"""
import hashlib
import json
import os
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks import Webhook

with open("local/secrets.toml", "rb") as secrets:
    SECRET = tomllib.load(secrets)["secrets"]["local/subscriber"]["current"]
PORT = int(os.environ.get("PORT", "9099"))
DOWN_SECONDS = float(os.environ.get("DOWN_SECONDS", "10"))
DOWN_AFTER = 60

log = open(sys.argv[1], "a", buffering=1)
lock = threading.Lock()
tried = set()
accepted = 0
go_down = threading.Event()


def record(**fields):
    log.write(json.dumps({"t": time.time(), **fields}) + "\n")


class Subscriber(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        global accepted
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {name.lower(): value for name, value in self.headers.items()}
        webhook_id = headers.get("webhook-id", "")
        try:
            Webhook(SECRET).verify(body, headers)
            verified = True
        except Exception:
            verified = False
        try:
            event_type = json.loads(body).get("type")
        except ValueError:
            event_type = None
        with lock:
            first_try = webhook_id not in tried
            tried.add(webhook_id)
            unlucky = int(hashlib.sha256(webhook_id.encode()).hexdigest(), 16) % 5 == 0
            status = 401 if not verified else 500 if first_try and unlucky else 200
            if status == 200:
                accepted += 1
                if accepted == DOWN_AFTER:
                    go_down.set()
        record(id=webhook_id, type=event_type, verified=verified, status=status)
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()


went_down = False
while True:
    server = ThreadingHTTPServer(("127.0.0.1", PORT), Subscriber)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if went_down:
        threading.Event().wait()
    go_down.wait()
    went_down = True
    server.shutdown()
    server.server_close()
    record(down_seconds=DOWN_SECONDS)
    time.sleep(DOWN_SECONDS)
    record(up=True)
