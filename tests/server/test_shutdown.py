"""Graceful shutdown of a real ``python -m ftjax.serve`` process: on SIGTERM the requests it
runs and those waiting finish whole, new ones get 503 with Retry-After in their API's shape,
/health says "shutting down", and the process exits 0; a second signal exits at once."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

TOKENS = 300  # per request: at max_running 1 the three take seconds, the drain's window


def _start(*flags):
  proc = subprocess.Popen([sys.executable, "-m", "ftjax.serve", "--model=default", "--port=0",
                           "--served_model_name=tiny", "--max_running=1", "--noprecompile",
                           *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  match = re.search(r"on http://(127\.0\.0\.1):(\d+)/v1", line)
  assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
  host, port = match.group(1), int(match.group(2))
  deadline = time.monotonic() + 300
  while _get(host, port, "/health")[0] != 200:
    assert time.monotonic() < deadline and proc.poll() is None, "the server did not get ready"
    time.sleep(0.2)
  return proc, host, port


def _get(host, port, path, method="GET", body=None):
  conn = http.client.HTTPConnection(host, port, timeout=30)
  try:
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), json.loads(response.read() or b"{}")
  except (ConnectionRefusedError, http.client.RemoteDisconnected):
    return None, {}, {}
  finally:
    conn.close()


def test_sigterm_finishes_running_requests_refuses_new_ones_and_exits_0():
  proc, host, port = _start("--shutdown_grace=120")
  try:
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0,
                           timeout=300)
    started = threading.Event()
    finished: dict[int, tuple[str, int]] = {}

    def stream(i):
      chunks = client.completions.create(model="tiny", prompt="def parse_args(argv):",
                                         max_tokens=TOKENS, temperature=1.0, seed=i,
                                         stream=True, stream_options={"include_usage": True})
      reason, used = None, 0
      for chunk in chunks:
        started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
          reason = chunk.choices[0].finish_reason
        if chunk.usage is not None:
          used = chunk.usage.completion_tokens
      finished[i] = (reason, used)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
      t.start()
    assert started.wait(120)
    deadline = time.monotonic() + 60
    while True:  # all three admitted or waiting before the signal
      body = _get(host, port, "/health")[2]
      if body.get("running", 0) + body.get("waiting", 0) == 3:
        break
      assert time.monotonic() < deadline, body
      time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # Draining: new requests are refused in their API's shape, with Retry-After.
    status, headers, body = _get(host, port, "/health")
    assert status == 503 and body["status"] == "shutting down", (status, body)
    with pytest.raises(openai.APIStatusError) as refused:
      client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert refused.value.status_code == 503
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["code"] == "shutting_down"
    status, headers, body = _get(host, port, "/v1/messages", "POST", {
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error" and "retry-after" in {
        k.lower() for k in headers}
    for t in threads:
      t.join(timeout=300)
    # Every admitted and waiting request finished whole.
    assert sorted(finished) == [0, 1, 2]
    assert all(reason == "length" and used == TOKENS for reason, used in finished.values()), \
        finished
    assert proc.wait(timeout=120) == 0
    err = proc.stderr.read()
    assert "SIGTERM: shutting down" in err and "every request finished" in err, err
    assert "Traceback" not in err
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_a_second_signal_exits_at_once():
  proc, host, port = _start("--shutdown_grace=600")
  try:
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0,
                           timeout=300)
    started = threading.Event()

    def stream():
      try:
        for _ in client.completions.create(model="tiny", prompt="def f(x):", max_tokens=20000,
                                           temperature=1.0, seed=0, stream=True):
          started.set()
      except (openai.APIError, ValueError):  # the connection closes under it
        pass

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert started.wait(120)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None  # draining: 600 s of grace
    begun = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert time.monotonic() - begun < 30
    assert proc.returncode == 0
    err = proc.stderr.read()
    assert "a second signal: 1 requests cancelled" in err, err
    assert "Traceback" not in err
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
