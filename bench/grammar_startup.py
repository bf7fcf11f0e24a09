"""A simulated server's start-up and its first structured requests, from the sources on the path.

Starts `deepinfer-server --engine simulated`, times launch -> /health 200, then one structured
request (a schema never compiled before), then a second with another schema, and prints the
three times and the first request's ratio to the second. Run it once per checkout to compare
(`PYTHONPATH=<checkout>/src python bench/grammar_startup.py`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _structured(base_url: str, name: str) -> float:
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    body = {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "thinking": {"type": "disabled"},
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    }
    started = time.perf_counter()
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "deepinfer_server", "--engine", "simulated"]
    started = time.perf_counter()
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            time.sleep(0.05)
        ready = time.perf_counter() - started
        first = _structured(base_url, "first")
        second = _structured(base_url, "second")
        print(f"start-up to /health 200: {ready:.1f} s")
        print(f"first structured request: {first:.2f} s, second: {second:.2f} s")
        print(f"first / second: {first / second:.1f}x")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
