"""lm-evaluation-harness against ``python -m ftjax.serve``, on both embedded models.

lm-evaluation-harness is installed from the registry into its own virtual environment
(``--venv``, made on first use): it is a client, never a dependency of ftjax. Three tasks are
written here as task YAMLs over local JSON data drawn from the code the embedded models never
saw (the training corpus's held-out files, ``ftjax.tiny.train.corpus_files``); nothing is
downloaded from a hub:

* ``ftjax_code_mc`` (multiple choice, loglikelihood): a held-out line's start, and its true end
  beside three other lines' ends;
* ``ftjax_code_ppl`` (perplexity, loglikelihood_rolling): held-out snippets;
* ``ftjax_code_gen`` (generate_until): a line's start, to be completed, through
  ``local-chat-completions`` with the chat template.

The first two run through ``local-completions`` (``/v1/completions`` with ``echo``,
``max_tokens`` 1 and ``logprobs``, token-id prompts). Each of their per-sample numbers is then
computed again through the JAX API (``Engine.prompt_logprobs`` on the token ids the harness
sent, found as the harness finds them) and compared: the goal is equality.

Run: ``python benchmarks/lm_eval_harness.py`` (``--models``, ``--limit``). Writes
``results/lm_eval_harness.json`` and ``.png`` (the harness's log-likelihoods against the JAX
API's), with the machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.runtime.tokenizer import load_tokenizer  # noqa: E402
from ftjax.tiny import train  # noqa: E402

LM_EVAL = "lm-eval[api]==0.4.13"  # the version this script was written against (and its
# API-model extras: tenacity, aiohttp)
MAX_LENGTH = 2048  # the harness's max_length (a rolling window): every snippet fits one


def ensure_lm_eval(venv: str) -> str:
  """The ``lm_eval`` executable of ``venv``, installing it from the registry first."""
  exe = os.path.join(venv, "bin", "lm_eval")
  if not os.path.exists(exe):
    print(f"installing {LM_EVAL} into {venv} (from the package registry)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", LM_EVAL, "transformers"],
                   check=True)  # transformers: the harness's tokenizer backend
  return exe


def held_out_lines(seed: int) -> tuple[list[str], list[str]]:
  """Lines (stripped of indentation, 30-100 characters) and ~1,200-character snippets of the
  held-out corpus files, shuffled by ``seed``."""
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  texts = train.read_texts(root, held, limit_bytes=2_000_000)
  lines = sorted({ln.strip() for t in texts for ln in t.splitlines()
                  if 30 <= len(ln.strip()) <= 100 and not ln.strip().startswith("#")})
  snippets = [t[i:i + 1200] for t in texts if len(t) > 2400 for i in (0, len(t) // 2)]
  rng = random.Random(seed)
  rng.shuffle(lines)
  rng.shuffle(snippets)
  return lines, snippets


def write_tasks(directory: str, limit: int, seed: int) -> None:
  """The three tasks' YAMLs and data under ``directory``."""
  lines, snippets = held_out_lines(seed)
  rng = random.Random(seed + 1)
  mc, gen = [], []
  for line in lines[:limit]:
    cut = len(line) // 2
    others = rng.sample([x for x in lines[limit:limit + 400] if x != line], 3)
    ends = [line[cut:]] + [o[len(o) // 2:] for o in others]
    order = list(range(4))
    rng.shuffle(order)
    mc.append({"context": line[:cut], "choices": [ends[i] for i in order],
               "label": order.index(0)})
  for line in lines[limit:2 * limit]:
    cut = len(line) // 2
    gen.append({"prompt": f"Complete this line of Python:\n{line[:cut]}", "target": line[cut:]})
  ppl = [{"text": s} for s in snippets[:max(2, limit // 4)]]
  for name, rows in (("mc", mc), ("gen", gen), ("ppl", ppl)):
    with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)

  def data(name):
    return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {os.path.join(directory, name + '.jsonl')}\ntest_split: test\n")

  tasks = {
      "ftjax_code_mc": data("mc") + (
          "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
          "doc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: \"\"\n"
          "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
      "ftjax_code_ppl": data("ppl") + (
          "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
          "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n"
          "  - metric: byte_perplexity\n  - metric: bits_per_byte\n"),
      "ftjax_code_gen": data("gen") + (
          "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\n"
          "doc_to_target: \"{{target}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
          "  max_gen_toks: 24\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
  }
  for name, text in tasks.items():
    with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
      f.write(f"task: {name}\n{text}")


def tokenizer_dir(model, directory: str) -> str:
  """The model's tokenizer as transformers loads it (the harness's ``tokenizer=``)."""
  out = os.path.join(directory, "tokenizer")
  os.makedirs(out, exist_ok=True)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(model.path, name), out)
  return out


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(name: str, port: int, log_path: str) -> subprocess.Popen:
  log = open(log_path, "w")  # noqa: SIM115 - closed with the process
  proc = subprocess.Popen([sys.executable, "-m", "ftjax.serve", f"--model={name}",
                           f"--port={port}", "--max_running=4"], stdout=log,
                          stderr=subprocess.STDOUT)
  deadline = time.time() + 600
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"ftjax.serve exited with {proc.returncode}: see {log_path}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        if r.status == 200:
          return proc
    except OSError:
      pass
    time.sleep(1)
  proc.kill()
  raise RuntimeError(f"ftjax.serve did not become healthy in 600 s: see {log_path}")


def run_lm_eval(exe: str, tasks: str, model_type: str, model_args: str, include: str,
                out: str, extra: list[str]) -> float:
  env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
         "TOKENIZERS_PARALLELISM": "false"}
  t0 = time.perf_counter()
  subprocess.run([exe, "--model", model_type, "--model_args", model_args, "--tasks", tasks,
                  "--include_path", include, "--output_path", out, "--log_samples",
                  "--batch_size", "1", *extra], check=True, env=env)
  return time.perf_counter() - t0


def read_outputs(out: str) -> tuple[dict, dict[str, list[dict]]]:
  """The harness's results (task -> metrics) and samples (task -> rows)."""
  results = {}
  for path in glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True):
    with open(path) as f:
      results.update(json.load(f)["results"])
  samples = {}
  for path in glob.glob(os.path.join(out, "**", "samples_*.jsonl"), recursive=True):
    task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
    with open(path) as f:
      samples[task] = [json.loads(line) for line in f]
  return results, samples


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """The harness's split of a (context, continuation) into token ids (``_encode_pair``:
  trailing spaces of the context move to the continuation; the whole is encoded, and the
  context's tokens are cut off its front)."""
  n = len(context) - len(context.rstrip())
  if n:
    context, continuation = context[:-n], context[-n:] + continuation
  whole = tok.encode(context + continuation)
  ctx = tok.encode(context)
  return ctx, whole[len(ctx):]


def _arguments(row: dict) -> list[list[str]]:
  """A logged sample's requests' arguments, in order (``gen_args_i``: ``arg_0``, ...)."""
  args = row["arguments"]
  if isinstance(args, list):
    return args
  keys = sorted(args, key=lambda k: int(k.rsplit("_", 1)[1]))
  return [[args[k][a] for a in sorted(args[k], key=lambda a: int(a.rsplit("_", 1)[1]))]
          for k in keys]


def _value(resp) -> float:
  """A logged response's log-likelihood (``[ll, is_greedy]``, or ``ll``, maybe as text)."""
  while isinstance(resp, list):
    resp = resp[0]
  return float(resp)


def jax_api_scores(engine, tok, samples: dict[str, list[dict]], prefix: int) -> dict:
  """Each harness number again through ``Engine.prompt_logprobs``: (harness, JAX API) pairs
  per task."""
  pairs = {"ftjax_code_mc": [], "ftjax_code_ppl": []}
  for row in samples.get("ftjax_code_mc", []):
    for (context, continuation), resp in zip(_arguments(row), row["resps"]):
      ctx, cont = encode_pair(tok, context, continuation)
      lps = engine.prompt_logprobs(ctx + cont)
      pairs["ftjax_code_mc"].append((_value(resp),
                                     float(sum(e.logprob for e in lps[len(ctx):]))))
  for row in samples.get("ftjax_code_ppl", []):
    text = _arguments(row)[0][0]
    ids = tok.encode(text)
    if len(ids) > MAX_LENGTH - 1:
      raise ValueError(f"a snippet of {len(ids)} tokens needs several rolling windows")
    lps = engine.prompt_logprobs([prefix] + ids)
    pairs["ftjax_code_ppl"].append((_value(row["resps"]),
                                    float(sum(e.logprob for e in lps[1:]))))
  return pairs


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="default,default-hybrid")
  p.add_argument("--limit", type=int, default=40, help="multiple-choice and generation items")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--venv", default=os.path.join(tempfile.gettempdir(), "ftjax-lm-eval-venv"))
  p.add_argument("--work_dir", default=None)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  exe = ensure_lm_eval(args.venv)
  work = args.work_dir or tempfile.mkdtemp(prefix="ftjax-lm-eval-")
  tasks_dir = os.path.join(work, "tasks")
  os.makedirs(tasks_dir, exist_ok=True)
  write_tasks(tasks_dir, args.limit, args.seed)
  report = {"machine": machine_info(), "lm_eval": LM_EVAL, "limit": args.limit,
            "models": {}}
  for name in args.models.split(","):
    model = ftjax.load(name)
    tok = load_tokenizer(model.path, model.config.vocab_size)
    tok_dir = tokenizer_dir(model, os.path.join(work, name))
    port = free_port()
    server = start_server(name, port, os.path.join(work, f"serve-{name}.log"))
    out = os.path.join(work, name, "out")
    try:
      base = f"http://127.0.0.1:{port}/v1"
      seconds = run_lm_eval(
          exe, "ftjax_code_mc,ftjax_code_ppl", "local-completions",
          f"base_url={base}/completions,model={name},tokenizer={tok_dir},"
          f"tokenizer_backend=huggingface,tokenized_requests=True,max_length={MAX_LENGTH},"
          "max_retries=1", tasks_dir, out, [])
      gen_seconds = run_lm_eval(
          exe, "ftjax_code_gen", "local-chat-completions",
          f"base_url={base}/chat/completions,model={name},max_retries=1", tasks_dir, out,
          ["--apply_chat_template"])
    finally:
      server.terminate()
      server.wait(60)
    results, samples = read_outputs(out)
    engine = ftjax.Engine(model)  # the JAX API, with the server's default options
    pairs = jax_api_scores(engine, tok, samples, prefix=0)
    diffs = {task: float(np.max(np.abs(np.subtract(*zip(*v))))) if v else None
             for task, v in pairs.items()}
    report["models"][name] = {
        "kernels": engine.kernels, "results": results,
        "seconds": {"loglikelihood_tasks": seconds, "generation_task": gen_seconds},
        "samples": {task: len(v) for task, v in samples.items()},
        "max_abs_difference_vs_jax_api": diffs, "pairs": pairs}
    print(f"{name}: {json.dumps(results)}", flush=True)
    print(f"{name}: harness vs JAX API, max |difference| per task: {diffs}", flush=True)
  path = write_results("lm_eval_harness", report, args.out)
  plt = pyplot()
  if plt is not None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, task in zip(axes, ("ftjax_code_mc", "ftjax_code_ppl")):
      for name, entry in report["models"].items():
        v = np.asarray(entry["pairs"][task])
        if len(v):
          ax.scatter(v[:, 1], v[:, 0], s=10, label=f"{name} (max |diff| "
                     f"{entry['max_abs_difference_vs_jax_api'][task]:.2g})")
      ax.set_xlabel("log-likelihood, JAX API (Engine.prompt_logprobs)")
      ax.set_ylabel("log-likelihood, lm-evaluation-harness via ftjax.serve")
      ax.set_title(task)
      ax.legend(fontsize=8)
    fig.suptitle(f"lm-evaluation-harness ({LM_EVAL}) against ftjax.serve: each sample's "
                 "number, both ways", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=110)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
