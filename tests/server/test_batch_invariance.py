"""The same tokens whatever else is in the batch (issue 54, item 5): eight different greedy and
seeded completions sent at once to a real server with the default kernels (``auto``: bfloat16
activations on AVX-512-BF16 CPUs), through the real ``openai`` client, each equal to itself sent
alone: its text, its tokens and its tokens' log-probabilities, bit for bit, on an attention and
a hybrid model.

The server decodes every request in a batch of ``max_running`` rows, so a request alone and
one beside others run the same programs; what differed was the expert kernel, whose decode form
ran an expert's routes together when several tokens chose it (a different summation order
than one route alone). 8 requests at ``max_running=4`` also join rows that others left. This
test passes on the old kernel under some kernel tunings (the one-token kernel's accumulators
decide whether the two orders differ); the kernel test (test_expert_ffn_invariance.py) covers
both tunings."""

from __future__ import annotations

import threading

import openai
import pytest

import ftjax
from ftjax.server import BackgroundServer, ServerConfig, create_app

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    if i % 3 == 0:",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()",
    "    return sorted(items, key=lambda item:",
    "with open(path) as f:\n    for line in f:",
    "try:\n    import json\nexcept ImportError:",
]
NEW = [14, 9, 18, 11, 16, 10, 17, 12]
# Greedy and seeded sampling alternate.
SAMPLING = [dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=i)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", params=("default", "default-hybrid"))
def served(request):
  model = ftjax.load(request.param)
  engine = ftjax.Engine(model)  # the default kernels
  rows = []
  dispatch = engine.executor._dispatch  # noqa: SLF001  (counted, not replaced)

  def counted(batch):
    rows.append(int(batch.go().sum()))
    return dispatch(batch)

  engine.executor._dispatch = counted  # noqa: SLF001
  server = BackgroundServer(create_app(engine, ServerConfig(model_name=request.param,
                                                            max_running=4)))
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=300)
  yield request.param, engine, server, client, rows
  server.stop()


def _complete(client, name, i):
  out = client.completions.create(model=name, prompt=PROMPTS[i], max_tokens=NEW[i], logprobs=1,
                                  **SAMPLING[i])
  choice = out.choices[0]
  return choice.text, list(choice.logprobs.tokens), list(choice.logprobs.token_logprobs)


def test_eight_requests_at_once_each_equal_alone(served):
  name, engine, _, client, rows = served
  assert engine.kernels.startswith("ffi")  # ftjax's C++ kernels, as a user's server runs
  alone = [_complete(client, name, i) for i in range(len(PROMPTS))]
  assert max(rows) == 1
  assert len({a[0] for a in alone}) == len(PROMPTS)  # different completions
  rows.clear()
  together: list = [None] * len(PROMPTS)
  start = threading.Barrier(len(PROMPTS))

  def send(i):
    start.wait()
    together[i] = _complete(client, name, i)

  threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  # Rows decoded beside others (how many at once depends on when each prompt was read: 4 on a
  # quiet machine, 3 seen under CI's load).
  assert max(rows) >= 2, rows
  for i, (a, b) in enumerate(zip(alone, together)):
    assert b == a, f"request {i} ({SAMPLING[i]}) differs beside others"
