"""Five OpenAI client libraries (openai, instructor, langchain-openai, pydantic-ai, litellm) against
`lucebox serve` on the built-in model, in their default and structured modes, with the standard
request fields that mean nothing to a local server set: which calls succeed, and every status the
server answered (no 422 for a no-op field is the point).

The libraries are not lucebox dependencies: install them in a Python of their own and name it,
  python3 -m venv /tmp/clients && /tmp/clients/bin/pip install openai instructor langchain-openai \\
      'pydantic-ai-slim[openai]' litellm
  python bench/client_libraries.py --python /tmp/clients/bin/python [--out bench/results]
The calls themselves are bench/client_probe.py. They reach the server through a recording proxy
here, which keeps each request's path, top-level fields and the server's status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import write_result

from lucebox.server.process import ServerProcess

KEY, MODEL = "sk-client-libraries", "laguna-code-6m"
PROBE = Path(__file__).resolve().parent / "client_probe.py"


class RecordingProxy(ThreadingHTTPServer):
    """Forwards every request to `target` whole and answers with the whole reply (a stream arrives at
    once: enough for a client library), keeping (path, the body's top-level fields, status)."""

    def __init__(self, target: str):
        self.target, self.seen, self.lock = target, [], threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self._forward(None)

    def do_POST(self):  # noqa: N802
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _forward(self, body: bytes | None) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length",
                                                                              "accept-encoding", "connection")}
        request = urllib.request.Request(self.server.target + self.path, data=body, headers=headers,
                                         method=self.command)
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                status, data, content_type = reply.status, reply.read(), reply.headers.get("Content-Type")
        except urllib.error.HTTPError as e:
            status, data, content_type = e.code, e.read(), e.headers.get("Content-Type")
        try:
            fields = sorted(json.loads(body)) if body else []
        except ValueError:
            fields = ["(not JSON)"]
        with self.server.lock:
            self.server.seen.append({"path": self.path, "fields": fields, "status": status,
                                     "error": json.loads(data).get("error") if status >= 400 else None})
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def _versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
            "('openai', 'instructor', 'langchain-openai', 'pydantic-ai-slim', 'litellm')}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="a Python with the five libraries installed")
    parser.add_argument("--out", help="where to write the result (default bench/results/local/)")
    args = parser.parse_args()
    server = ServerProcess(api_key=KEY)  # no flags: the built-in model's tools take the generic JSON syntax
    proxy = RecordingProxy(server.url)
    try:
        env = {**os.environ, "LUCEBOX_URL": proxy.url, "LUCEBOX_KEY": KEY, "LUCEBOX_MODEL": MODEL}
        run = subprocess.run([args.python, str(PROBE)], capture_output=True, text=True, env=env, timeout=900)
    finally:
        proxy.shutdown()
        server.stop()
    calls = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    statuses: dict[str, int] = {}
    for request in proxy.seen:
        statuses[str(request["status"])] = statuses.get(str(request["status"]), 0) + 1
    for call in calls:
        print(f"{call['library']:17} {call['mode']:28} {'ok' if call['ok'] else 'FAILED: ' + call['error'][:150]}")
    print(f"server statuses: {statuses}")
    path = write_result("client_libraries", {"versions": _versions(args.python), "calls": calls,
                                             "server_statuses": statuses, "requests": proxy.seen,
                                             "probe_stderr": run.stderr[-2000:]},
                        args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
