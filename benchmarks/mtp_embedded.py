"""MTP speculative decoding on the embedded hybrid model, whose head is trained (issue 30):
acceptance per draft position and tok/s against plain decode, in ftjax and, on the same
weights, in llama.cpp's ``--spec-type draft-mtp``.

The model: ``default-hybrid`` (``ftjax.tiny.train --arch=hybrid``: 8 layers, Gated DeltaNet
and gated attention, 32 experts top-4, vocabulary 4096), whose multi-token-prediction head was
trained on the finished model (``train_mtp``: self-distillation to the model's own
next-next-token distribution). The prompts: the first ``--prompt_tokens`` tokens of held-out
standard-library files (the training split's held-out files, natural code the model never
saw), each continued greedily for ``--tokens`` tokens.

ftjax (in this process, ``--kernels``, by default the exact ``ffi``: then speculative greedy
tokens equal plain greedy ones, checked on every run): plain decode (``generate_timed``),
fixed draft lengths k = 1 .. 4 and the adaptive rule (up to 4). Per configuration: decode
tok/s over all prompts (first tokens left out), tokens per verify step, and per draft
position i the share of verify steps that kept draft i (and given draft i - 1 kept).

llama.cpp (``llama-server`` of ``--llama_build``, ``-t --threads``, weights in RAM): the
model exported to a Hugging Face checkpoint by ``ftw_to_hf.py`` (checked to convert back to
the same bits with ftjax's own converter), converted with llama.cpp's converter keeping the
MTP layer (GGUF ``blk.8``, ``nextn_predict_layers = 1``; the copy of the converter whose
pre-tokenizer is patched as in ``agent_peer.py``); plain, and ``--spec-type draft-mtp
--spec-draft-n-max k`` for k = 1 .. 4. The same prompt token ids (``/completion`` with a
token array, ``temperature`` 0, ``ignore_eos``); tok/s is ``timings.predicted_per_second``
and the acceptance ``draft_n_accepted / draft_n`` (per drafted token; llama.cpp reports no
per-position counts). Its greedy tokens are compared with ftjax's.

Rounds (``--rounds``) alternate the two engines' order and the configurations' order;
medians of tok/s, and of each round's ratio to that round's plain decode (the VM's speed
drifts between rounds). One warm-up request per server and one warm-up pass of ftjax
(compiles) are not counted.

  /work/venv/bin/python benchmarks/mtp_embedded.py      # ~5 min (+ a minute to convert once)
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_peer import (  # noqa: E402
  HTTP_TIMEOUT_S,
  Server,
  free_port,
  gguf_converter,
  post,
  read_json,
  write_json,
)
from common import machine_info, pyplot, write_results  # noqa: E402
from ftw_to_hf import check_round_trip, export_hf  # noqa: E402

LLAMA_BUILD = "/work/scratch/llama/build"
LLAMA_SRC = "/work/scratch/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
KS = (1, 2, 3, 4)


def log(msg: str) -> None:
  print(f"[mtp_embedded] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> str:
  base = os.environ.get("FTJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "ftjax")
  return os.path.join(base, "mtp_embedded")


def prompts(model_dir: str, vocab: int, count: int, length: int) -> list[list[int]]:
  """The first ``length`` tokens of the first ``count`` held-out files that have as many."""
  from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
  from ftjax.tiny import train  # noqa: PLC0415
  tok = load_tokenizer(model_dir, vocab)
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  out = []
  for text in train.read_texts(root, held):
    ids = tok.encode(text)
    if len(ids) >= length:
      out.append(list(ids[:length]))
      if len(out) == count:
        return out
  raise RuntimeError(f"only {len(out)} held-out files have {length} tokens")


# -- ftjax ------------------------------------------------------------------------------------

def ftjax_run(engine, batch: list[list[int]], n: int, k: int | None, adaptive: bool,
              reference: list[list[int]] | None) -> dict:
  """One configuration over all prompts: tok/s, tokens per step, per-position acceptance."""
  decode_s, tokens, steps, lengths = 0.0, 0, 0, [0] * (max(KS) + 1)
  accepted = [0] * (k or 0)
  differs = []
  for i, ids in enumerate(batch):
    if k is None:
      r = engine.generate_timed(ids, n, greedy=True)
    else:
      r = engine.generate_speculative(ids, n, draft_tokens=k, adaptive=adaptive)
      steps += r.steps
      accepted = [a + b for a, b in zip(accepted, r.accepted)]
      lengths = [a + b for a, b in zip(lengths, r.lengths + [0] * len(lengths))]
    decode_s += r.decode_s
    tokens += len(r.tokens) - 1
    if reference is not None and r.tokens != reference[i]:
      differs.append(next(j for j, (a, b) in enumerate(zip(r.tokens, reference[i])) if a != b))
  row = {"tok_s": tokens / decode_s, "decode_s": decode_s, "tokens": tokens,
         "differs_at": differs}
  if k is not None:
    row.update(steps=steps, accepted=accepted, tokens_per_step=tokens / steps,
               per_drafted_token=sum(accepted) / max(1, sum(j * c for j, c in
                                                            enumerate(lengths))),
               lengths=lengths)
    if not adaptive:  # (adaptive steps draft 0 .. k: the counts do not say which reached i)
      before = [steps] + accepted[:-1]  # steps that reached draft position i
      row.update(acceptance=[a / steps for a in accepted],
                 conditional=[a / b if b else 0.0 for a, b in zip(accepted, before)])
  return row


# -- llama.cpp --------------------------------------------------------------------------------

def fingerprint(ftw_dir: str) -> str:
  h = hashlib.sha256()
  for name in ("ftw.json", "tokenizer.json"):
    with open(os.path.join(ftw_dir, name), "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def prepare_gguf(ftw_dir: str, args) -> tuple[str, dict]:
  """The GGUF (bf16, MTP kept) of the FTW model under the cache dir, remade when the model or
  the llama.cpp source changes; with the round-trip check of the export."""
  d = args.cache_dir
  os.makedirs(d, exist_ok=True)
  gguf, stamp_path = os.path.join(d, "model-mtp-bf16.gguf"), os.path.join(d, "stamp.json")
  stamp = {"model": fingerprint(ftw_dir), "llama_src": os.path.abspath(args.llama_src)}
  round_trip_path = os.path.join(d, "round_trip.json")
  if read_json(stamp_path) == stamp and os.path.isfile(gguf):
    return gguf, read_json(round_trip_path)
  hf_dir = os.path.join(d, "hf")
  log(f"exporting {ftw_dir} as a Hugging Face checkpoint into {hf_dir}")
  export_hf(ftw_dir, hf_dir, overwrite=True)
  round_trip = check_round_trip(ftw_dir, hf_dir)
  log(f"round trip through ftjax's converter: {round_trip}")
  script = gguf_converter(args.llama_src, os.path.join(d, "llama-convert"))
  log_path = os.path.join(d, "convert_gguf.log")
  with open(log_path, "w") as f:  # no --no-mtp: the MTP layer stays, as blk.{num_layers}
    proc = subprocess.run([sys.executable, script, hf_dir, "--outtype", "bf16", "--outfile",
                           gguf + ".partial"], stdout=f, stderr=subprocess.STDOUT)
  if proc.returncode:
    with open(log_path) as f:
      raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}; it needs "
                         f"pip install {args.llama_src}/gguf-py):\n{f.read()[-3000:]}")
  os.rename(gguf + ".partial", gguf)
  write_json(round_trip_path, round_trip)
  write_json(stamp_path, stamp)
  return gguf, round_trip


def llama_run(args, gguf: str, batch: list[list[int]], n: int, k: int | None,
              reference: list[list[int]]) -> dict:
  """One llama-server (plain, or draft-mtp with up to k drafts) over all prompts."""
  cmd = [os.path.join(args.llama_build, "bin", "llama-server"), "-m", gguf, "-t",
         str(args.threads), "-c", "4096", "-np", "1", "-lm", "none", "--host", "127.0.0.1",
         "--port", str(free_port())]
  if k is not None:
    cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)]
  server = Server("llama-server", cmd, os.path.join(
      args.cache_dir, f"server-{'plain' if k is None else k}.log"), cwd=args.cache_dir)
  body = {"n_predict": n, "temperature": 0, "cache_prompt": False, "ignore_eos": True,
          "return_tokens": True}
  try:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_S)

    def complete(ids: list[int]) -> dict:
      return post(conn, "/completion", json.dumps(dict(body, prompt=ids)).encode())[0]

    complete(batch[0])  # warm-up
    ms, predicted, drafted, kept, equal = 0.0, 0, 0, 0, []
    for i, ids in enumerate(batch):
      r = complete(ids)
      t = r["timings"]
      if t["prompt_n"] != len(ids):
        raise RuntimeError(f"llama-server read {t['prompt_n']} prompt tokens, not {len(ids)}")
      ms += t["predicted_ms"]
      predicted += t["predicted_n"]
      drafted += t.get("draft_n", 0)
      kept += t.get("draft_n_accepted", 0)
      out = r["tokens"]
      # tokens equal to ftjax's plain greedy ones before the first that differs
      equal.append(next((j for j, (a, b) in enumerate(zip(out, reference[i])) if a != b),
                        min(len(out), len(reference[i]))))
    conn.close()
  finally:
    server.stop()
  # predicted_ms covers the generated tokens after the first (which the prompt pass makes).
  row = {"tok_s": predicted / (ms / 1e3), "tokens": predicted, "equal_to_ftjax": equal}
  if k is not None:
    row.update(drafted=drafted, accepted=kept, per_drafted_token=kept / max(drafted, 1))
  return row


# -- main -------------------------------------------------------------------------------------

def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="default-hybrid")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--prompt_tokens", type=int, default=64)
  p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--kernels", default="ffi")
  p.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
  p.add_argument("--cache_dir", default=default_cache_dir())
  p.add_argument("--llama_build", default=LLAMA_BUILD, help="bin/llama-server in it")
  p.add_argument("--llama_src", default=LLAMA_SRC, help="llama.cpp source (the converter)")
  p.add_argument("--no_llama", action="store_true", help="ftjax only")
  p.add_argument("--out", default=None)
  args = p.parse_args()

  import ftjax  # noqa: PLC0415
  from ftjax.assets import EMBEDDED_MODELS  # noqa: PLC0415
  model_dir = EMBEDDED_MODELS.get(args.model, args.model)
  model = ftjax.load(model_dir)
  c = model.config
  if not c.mtp_layers:
    raise SystemExit(f"{model_dir} has no MTP head: train one with python -m ftjax.tiny.train "
                     "--arch=hybrid")
  batch = prompts(model_dir, c.vocab_size, args.prompts, args.prompt_tokens)
  n = args.tokens
  engine = ftjax.Engine(model, max_seq_len=args.prompt_tokens + n + 8, kernels=args.kernels)
  log(f"ftjax kernels: {engine.kernels_path}; {len(batch)} prompts of {args.prompt_tokens} "
      f"tokens, {n} new tokens each")
  reference = [list(engine.generate(ids, n, greedy=True)) for ids in batch]
  configs = [("plain", None, False)] + [(f"k={k}", k, False) for k in KS]
  configs.append(("adaptive", max(KS), True))
  gguf, round_trip = (None, None) if args.no_llama else prepare_gguf(model_dir, args)
  llama_configs = [] if args.no_llama else [("plain", None)] + [(f"k={k}", k) for k in KS]

  log("warm-up pass (compiles)")
  for name, k, adaptive in configs:
    ftjax_run(engine, batch[:1], n, k, adaptive, None)
  rounds = []
  for i in range(args.rounds):
    row = {"ftjax": {}, "llama": {}}
    sides = ["ftjax", "llama"] if i % 2 == 0 else ["llama", "ftjax"]
    for side in sides:
      if side == "ftjax":
        for name, k, adaptive in (configs if i % 2 == 0 else configs[::-1]):
          row["ftjax"][name] = ftjax_run(engine, batch, n, k, adaptive, reference)
      else:
        for name, k in (llama_configs if i % 2 == 0 else llama_configs[::-1]):
          row["llama"][name] = llama_run(args, gguf, batch, n, k, reference)
    log(f"round {i + 1}: ftjax " + ", ".join(f"{name} {r['tok_s']:.0f}"
                                            for name, r in row["ftjax"].items())
        + ("" if args.no_llama else "; llama.cpp " + ", ".join(
            f"{name} {r['tok_s']:.0f}" for name, r in row["llama"].items())) + " tok/s")
    rounds.append(row)

  def med(side: str, name: str) -> float:
    return statistics.median(r[side][name]["tok_s"] for r in rounds)

  def of_plain(side: str, name: str) -> float:  # per round, against that round's plain run
    return statistics.median(r[side][name]["tok_s"] / r[side]["plain"]["tok_s"] for r in rounds)

  last = rounds[-1]
  ftjax_rows = {}
  for name, k, _ in configs:
    r = last["ftjax"][name]
    ftjax_rows[name] = {"tok_s": med("ftjax", name),
                        "of_plain": of_plain("ftjax", name),
                        "equals_plain_greedy": all(not x["ftjax"][name]["differs_at"]
                                                   for x in rounds)}
    if k is not None:
      ftjax_rows[name].update({key: r[key] for key in (
          "acceptance", "conditional", "per_drafted_token", "tokens_per_step", "lengths")
          if key in r})
  llama_rows = {}
  for name, k in llama_configs:
    r = last["llama"][name]
    llama_rows[name] = {"tok_s": med("llama", name),
                        "of_plain": of_plain("llama", name),
                        "prompts_equal_to_ftjax": sum(e == n for e in r["equal_to_ftjax"]),
                        "mean_tokens_equal_to_ftjax": statistics.mean(r["equal_to_ftjax"])}
    if k is not None:
      llama_rows[name].update(per_drafted_token=r["per_drafted_token"], drafted=r["drafted"],
                              accepted=r["accepted"])
  results = {"benchmark": "mtp_embedded", "machine": machine_info(), "model": model_dir,
             "source": model.source, "kernels": engine.kernels_path,
             "llama_threads": args.threads, "prompts": len(batch),
             "prompt_tokens": args.prompt_tokens, "tokens": n,
             "export_round_trip": round_trip, "ftjax": ftjax_rows, "llama": llama_rows,
             "ftjax_plain_tokens": reference, "rounds": rounds}

  print(f"\n{'':>9} | {'ftjax':>7} {'of plain':>8} {'kept/draft':>10} {'tok/step':>8}  "
        f"{'per position (given previous)':<36}| {'llama.cpp':>9} {'of plain':>8} "
        f"{'kept/draft':>10}")
  for name, _, _ in configs:
    f = ftjax_rows[name]
    pos = ""
    if "acceptance" in f:
      pos = " ".join(f"{a:.2f}({cnd:.2f})" for a, cnd in zip(f["acceptance"], f["conditional"]))
    elif "lengths" in f:
      pos = f"steps with 0..{max(KS)} drafts: {f['lengths']}"
    line = (f"{name:>9} | {f['tok_s']:7.0f} {f['of_plain']:8.2f} "
            f"{f.get('per_drafted_token', float('nan')):10.2f} "
            f"{f.get('tokens_per_step', 1.0):8.2f}  {pos:<36}|")
    if name in llama_rows:
      lr = llama_rows[name]
      line += (f" {lr['tok_s']:9.0f} {lr['of_plain']:8.2f} "
               f"{lr.get('per_drafted_token', float('nan')):10.2f}")
    print(line)
  if llama_rows:
    print(f"llama.cpp's greedy tokens equal ftjax's on {llama_rows['plain']['prompts_equal_to_ftjax']}"
          f" of {len(batch)} prompts (mean {llama_rows['plain']['mean_tokens_equal_to_ftjax']:.0f}"
          f" of {n} tokens before they part)")
  path = write_results("mtp_embedded", results, args.out)
  plt = pyplot()
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  names = [name for name, _, _ in configs]
  xs = range(len(names))
  a1.bar([x - 0.2 for x in xs], [ftjax_rows[nm]["of_plain"] for nm in names], 0.4, label="ftjax")
  if llama_rows:
    a1.bar([x + 0.2 for x in xs if names[x] in llama_rows],
           [llama_rows[nm]["of_plain"] for nm in names if nm in llama_rows], 0.4,
           label="llama.cpp draft-mtp")
  a1.axhline(1.0, color="gray", lw=1)
  a1.set_xticks(list(xs), names)
  a1.set_ylabel("decode tok/s / own plain decode")
  a1.legend(fontsize=8)
  for k in KS:
    f = ftjax_rows[f"k={k}"]
    a2.plot(range(1, k + 1), f["conditional"], "o-", label=f"k={k}")
  a2.set_xlabel("draft position")
  a2.set_ylabel("kept, given the previous draft kept")
  a2.set_ylim(0, 1)
  a2.legend(fontsize=8)
  fig.suptitle("MTP speculative decoding on the embedded hybrid model (trained head)")
  fig.tight_layout()
  png = path[:-len(".json")] + ".png"
  fig.savefig(png, dpi=120)
  print(f"wrote {path} and {png}")


if __name__ == "__main__":
  main()
