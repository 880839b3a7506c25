"""`lucebox serve` in a subprocess on a free localhost port: started, awaited and stopped the way a
user would (Ctrl-C). The tests and `bench/serve_load.py` use it; so can a notebook or a script."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`lucebox serve FLAGS...` on 127.0.0.1; ready when the constructor returns."""

    def __init__(self, *flags: str, api_key: str | None = None, startup_timeout: float = 120.0):
        self.port, self.api_key = free_port(), api_key
        self.url = f"http://127.0.0.1:{self.port}"
        key = ["--api-key", api_key] if api_key else []
        # its output goes to a file, not a pipe nobody drains (a full pipe would stall the server)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "lucebox.cli", "serve", "--port", str(self.port),
                                      *key, *flags], stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + startup_timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    output = self.output()
                    raise RuntimeError(f"lucebox serve exited with {self.proc.returncode}: {output}") from None
                if time.time() > deadline:
                    self.proc.kill()
                    raise TimeoutError(f"lucebox serve did not answer /health within {startup_timeout} s") from None
                time.sleep(0.2)

    def output(self) -> str:
        """What the server has printed so far."""
        self.log.seek(0)
        return self.log.read()

    def post(self, path: str, body: bytes, key: str | None = None, headers: dict | None = None):
        """(status, decoded JSON, headers) of a POST with raw bytes as the body."""
        request = urllib.request.Request(self.url + path, data=body, method="POST", headers={
            "Content-Type": "application/json", **self.key_header(key), **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def key_header(self, key: str | None = None) -> dict:
        """The Authorization header with `key` (default: the server's), or none when there is no key."""
        key = key if key is not None else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def metric(self, name: str) -> float:
        """A value from /metrics (`name` without the lucebox_ prefix)."""
        request = urllib.request.Request(self.url + "/metrics", headers=self.key_header())
        text = urllib.request.urlopen(request, timeout=10).read().decode()
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"lucebox_{name} ")))

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGINT) -> int:
        """Ctrl-C (or `sig`), then the exit status."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
