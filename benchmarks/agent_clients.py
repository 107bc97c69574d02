"""The three coding-agent CLIs end to end against ftjax.serve, through ``python -m ftjax.launch``.

  python benchmarks/agent_clients.py                      # claude, codex, opencode
  python benchmarks/agent_clients.py --clients=codex --model=default

Installs Claude Code (``@anthropic-ai/claude-code``), Codex (``@openai/codex``) and OpenCode
(``opencode-ai``) from npm into ``--npm_dir`` (not the user's global packages), then runs each
one non-interactively through ``python -m ftjax.launch CLIENT --model=MODEL`` (the server's
default flags otherwise) on a small task in a fresh temporary git repository. It records the
client's exit status and wall time, every HTTP request the server answered (method, path,
status, from its access log) and, per generation, the prompt tokens, the tokens the session
reused and the time to first token (the server's ``ftjax request:`` log lines). Goals (issue
31): every request 2xx, every client exits 0.

Writes ``results/agent_clients.json`` (with the machine and the clients' versions) and
``results/agent_clients.png`` (TTFT per request, per client). The embedded models are tiny and
were never trained on chat: what they write is not an answer, and no tool call is expected to
parse; the run checks that each client and the server talk, not what the model says.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from common import machine_info, pyplot, write_results, RESULTS_DIR

PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex",
            "opencode": "opencode-ai"}
TASK = "Fix the bug in calc.py so that add(2, 3) returns 5."
ARGS = {  # non-interactive, one task
    "claude": ["-p", TASK, "--max-turns", "3"],
    "codex": ["exec", "--skip-git-repo-check", TASK],
    "opencode": ["run", TASK],
}
ACCESS = re.compile(r'"(GET|POST|HEAD|PUT|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')
REQUEST = re.compile(r"ftjax request: endpoint=(\S+) prompt=(\d+) reused=(\d+) generated=(\d+) "
                     r"ttft_s=([\d.]+) finish=(\S+)")


def install(npm_dir: str, clients: list[str]) -> dict[str, str]:
  """Installs the clients with npm under ``npm_dir``; returns their versions."""
  os.makedirs(npm_dir, exist_ok=True)
  command = ["npm", "install", "--no-audit", "--no-fund", "--prefix", npm_dir,
             *(PACKAGES[c] for c in clients)]
  print("+", " ".join(command), flush=True)
  subprocess.run(command, check=True)
  versions = {}
  for c in clients:
    done = subprocess.run([os.path.join(npm_dir, "node_modules", ".bin", c), "--version"],
                          capture_output=True, text=True, timeout=60, check=False)
    versions[c] = (done.stdout or done.stderr).strip().splitlines()[-1]
  return versions


def make_repo(path: str) -> None:
  os.makedirs(path)
  with open(os.path.join(path, "calc.py"), "w") as f:
    f.write("def add(a, b):\n    return a - b\n")
  for command in (["git", "init", "-q"], ["git", "add", "."],
                  ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit",
                   "-qm", "calc"]):
    subprocess.run(command, cwd=path, check=True)


def run_client(client: str, npm_dir: str, model: str, work: str, timeout_s: float) -> dict:
  repo = os.path.join(work, f"repo-{client}")
  make_repo(repo)
  log = os.path.join(work, f"server-{client}.log")
  command = [sys.executable, "-m", "ftjax.launch", client,
             f"--client_bin={os.path.join(npm_dir, 'node_modules', '.bin', client)}",
             f"--model={model}", "--log_level=info", f"--server_log={log}", "--", *ARGS[client]]
  print(f"\n== {client}: {' '.join(command[2:])}", flush=True)
  t0 = time.monotonic()
  try:
    done = subprocess.run(command, cwd=repo, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    rc, out = done.returncode, done.stdout + done.stderr
  except subprocess.TimeoutExpired as e:
    rc, out = "timeout", (e.stdout or b"").decode(errors="replace")
  wall = time.monotonic() - t0
  with open(log) as f:
    text = f.read()
  http = [{"method": m, "path": p, "status": int(s)} for m, p, s in ACCESS.findall(text)]
  generations = [{"endpoint": e, "prompt": int(p), "reused": int(r), "generated": int(g),
                  "ttft_s": float(t), "finish": fin}
                 for e, p, r, g, t, fin in REQUEST.findall(text)]
  row = {"exit": rc, "wall_s": round(wall, 1), "requests": http, "generations": generations,
         "all_2xx": bool(http) and all(200 <= r["status"] < 300 for r in http),
         "output_tail": out[-1500:]}
  kinds = sorted({f"{r['method']} {r['path']} {r['status']}" for r in http})
  print(f"   exit {rc} in {wall:.0f} s; {len(http)} requests ({', '.join(kinds)}); "
        f"TTFT {[g['ttft_s'] for g in generations]} s; reused "
        f"{[g['reused'] for g in generations]} of {[g['prompt'] for g in generations]} tokens",
        flush=True)
  return row


def plot(rows: dict, path: str, title: str) -> str | None:
  plt = pyplot()
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for client, row in rows.items():
    ttft = [g["ttft_s"] for g in row["generations"]]
    ax.plot(range(1, len(ttft) + 1), ttft, "o-", label=f"{client} (exit {row['exit']})")
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.set_xlabel("generation request")
  ax.set_ylabel("time to first token (s)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  return path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--clients", default="claude,codex,opencode")
  parser.add_argument("--model", default="default-hybrid")
  parser.add_argument("--npm_dir", default=os.path.join(
      os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ftjax",
      "agent-clients"))
  parser.add_argument("--timeout_s", type=float, default=1200)
  args = parser.parse_args()
  clients = [c for c in args.clients.split(",") if c]
  unknown = set(clients) - set(PACKAGES)
  if unknown:
    sys.exit(f"unknown clients {sorted(unknown)}: choose from {sorted(PACKAGES)}")
  if shutil.which("npm") is None:
    sys.exit("npm is not installed: the clients come from the npm registry")
  versions = install(args.npm_dir, clients)
  work = tempfile.mkdtemp(prefix="ftjax-agent-clients-")
  try:
    rows = {c: run_client(c, args.npm_dir, args.model, work, args.timeout_s) for c in clients}
  finally:
    shutil.rmtree(work, ignore_errors=True)
  goals = {"every client exits 0": all(r["exit"] == 0 for r in rows.values()),
           "every request 2xx": all(r["all_2xx"] for r in rows.values())}
  results = {"machine": machine_info(), "model": args.model, "task": TASK, "args": ARGS,
             "versions": versions, "clients": rows, "goals": goals}
  results["plot"] = plot(rows, os.path.join(RESULTS_DIR, "agent_clients.png"),
                         f"agent CLIs on ftjax.serve ({args.model}), "
                         f"{results['machine']['cpu_model']}")
  print(f"\ngoals: {goals}\nwrote {write_results('agent_clients', results)}")


if __name__ == "__main__":
  main()
