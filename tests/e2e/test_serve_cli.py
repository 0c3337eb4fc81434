"""`loraplex serve` as a user runs it: a real process on a real port, default model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from support.ports import free_port


@pytest.mark.slow
def test_serve_default_model_answers_chat() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "serve",
        "--port",
        str(port),
        "--kv-cache-memory",
        "256MiB",
        "--single-tenant",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "server exited"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up in 180 s"
            time.sleep(1)
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert models[0]["id"] == "SmolLM2-135M-Instruct"
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 20,
            "temperature": 0,
        }
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        bad = httpx.post(f"{base}/v1/chat/completions", json={**body, "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        # SIGTERM stops the server even with a long stream open: after the grace period
        # (--graceful-shutdown-s, 10 s by default) what still runs ends with an error event, and
        # the process ends as SIGTERM ends it (uvicorn raises it again once it has shut down).
        long = {**body, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=long, timeout=120) as r:
            assert r.status_code == 200
            next(r.iter_lines())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        # One bare JSON access-log line per request, without the prompt's text.
        output = proc.stdout.read() if proc.stdout else ""
        access = [json.loads(line) for line in output.splitlines() if line.startswith('{"ts"')]
        chats = [e for e in access if e["path"] == "/v1/chat/completions"]
        assert [e["status"] for e in chats][:2] == [200, 400], output
        assert chats[0]["tenant"] == "local" and chats[0]["generated_tokens"] > 0
        assert "capital of France" not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
