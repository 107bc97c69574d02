"""Peak memory and throughput of the Hugging Face -> FTW converter (``ftjax.convert_hf``).

The converter claims to stream tensor by tensor, so that its peak memory stays far below the
checkpoint size. This benchmark measures that on a synthetic Qwen3-MoE checkpoint it writes
itself (float32, about 1.9 GB with the defaults; nothing is downloaded or kept):

1. A tiny checkpoint is converted first and read back, to check that every tensor name maps
   and that the values survive (bfloat16 rounding only).
2. The full checkpoint is written shard by shard (``safetensors.numpy.save_file``), then read
   once (``cat > /dev/null``) so that the converter and the peer both read from page cache.
3. Alternating, ``--repeats`` times: ``convert_hf(dtype="bfloat16")`` in a child process whose
   ``/proc/<pid>/status`` is sampled every ``--interval_s`` (peak RssAnon: memory the
   converter really holds; peak RssFile: mapped file pages, reclaimable page cache), and the
   peer, ``cp`` of the same shards to another directory on the same filesystem (a lower bound
   on the time to read and write every byte; it writes twice the converter's bfloat16 output),
   also timed with an fsync of the copies, and ``cat > /dev/null`` of the shards (the read
   alone). ``sync`` runs, untimed, before the conversion and before cp.

Reported: medians of conversion GB/s (source bytes / convert_hf time) and its ratio to cp's
GB/s, and peak RssAnon / checkpoint bytes. Results go to ``benchmarks/results/convert_memory.json``.

  /work/venv/bin/python benchmarks/convert_memory.py          # about 35 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "convert_memory.json")
MIB = 1 << 20
# -P: the child imports the installed ftjax, as the tests do, not a checkout in its cwd.
PYTHON = (sys.executable, "-P", "-c")
GB = 1e9

# Runs in the child: import first (so the import's memory is the baseline), then convert.
# Prints one JSON line with its own /proc status before and after, and convert_hf's time.
CHILD = r"""
import json, sys, time
import ftjax
def status():
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
        out[key] = int(value.split()[0]) * 1024
  return out
before = status()
start = time.perf_counter()
ftjax.convert_hf(sys.argv[1], sys.argv[2], dtype=sys.argv[3], show_progress=True)
seconds = time.perf_counter() - start
print(json.dumps({"before": before, "after": status(), "convert_s": seconds}), flush=True)
"""


def read_status(pid: int) -> dict[str, int] | None:
  """RssAnon, RssFile, RssShmem, VmRSS of a live process, in bytes (None once it is gone)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      text = f.read()
  except (FileNotFoundError, ProcessLookupError):
    return None
  out = {}
  for line in text.splitlines():
    key, _, value = line.partition(":")
    if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
      out[key] = int(value.split()[0]) * 1024
  return out if "RssAnon" in out else None  # a zombie has no memory lines


# --- synthetic checkpoint -----------------------------------------------------------------


def hf_config(args) -> dict:
  return {
      "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "hidden_size": args.hidden, "num_hidden_layers": args.layers,
      "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
      "head_dim": args.head_dim, "num_experts": args.experts,
      "num_experts_per_tok": min(8, args.experts),
      "moe_intermediate_size": args.ffn, "intermediate_size": 3 * args.hidden,
      "vocab_size": args.vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
      "rope_theta": 1000000.0, "rope_scaling": None, "norm_topk_prob": True,
      "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
      "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
      "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
  }


def shard_tensors(args, rng: np.random.Generator, layers: range, first: bool,
                  last: bool) -> dict[str, np.ndarray]:
  """The tensors of one shard: its layers, plus the embedding (first) or the head (last)."""
  d, f, e = args.hidden, args.ffn, args.experts
  q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim

  def weight(*shape):
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= 0.02
    return w

  def norm(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  t = {}
  if first:
    t["model.embed_tokens.weight"] = weight(args.vocab, d)
  for i in layers:
    p = f"model.layers.{i}."
    t[p + "input_layernorm.weight"] = norm(d)
    t[p + "post_attention_layernorm.weight"] = norm(d)
    t[p + "self_attn.q_proj.weight"] = weight(q, d)
    t[p + "self_attn.k_proj.weight"] = weight(kv, d)
    t[p + "self_attn.v_proj.weight"] = weight(kv, d)
    t[p + "self_attn.o_proj.weight"] = weight(d, q)
    t[p + "self_attn.q_norm.weight"] = norm(args.head_dim)
    t[p + "self_attn.k_norm.weight"] = norm(args.head_dim)
    t[p + "mlp.gate.weight"] = weight(e, d)
    for x in range(e):
      t[p + f"mlp.experts.{x}.gate_proj.weight"] = weight(f, d)
      t[p + f"mlp.experts.{x}.up_proj.weight"] = weight(f, d)
      t[p + f"mlp.experts.{x}.down_proj.weight"] = weight(d, f)
  if last:
    t["model.norm.weight"] = norm(d)
    t["lm_head.weight"] = weight(args.vocab, d)
  return t


def write_checkpoint(args, hf_dir: str, seed: int = 0) -> list[str]:
  """Writes config.json, the shards (one at a time) and the index; returns the shard paths."""
  from safetensors.numpy import save_file  # noqa: PLC0415

  os.makedirs(hf_dir)
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump(hf_config(args), f, indent=1)
  rng = np.random.default_rng(seed)
  starts = list(range(0, args.layers, args.layers_per_shard))
  weight_map, paths, total = {}, [], 0
  for k, start in enumerate(starts):
    name = f"model-{k + 1:05d}-of-{len(starts):05d}.safetensors"
    layers = range(start, min(start + args.layers_per_shard, args.layers))
    tensors = shard_tensors(args, rng, layers, first=k == 0, last=k == len(starts) - 1)
    save_file(tensors, os.path.join(hf_dir, name), metadata={"format": "pt"})
    total += sum(t.nbytes for t in tensors.values())
    weight_map.update(dict.fromkeys(tensors, name))
    paths.append(os.path.join(hf_dir, name))
    del tensors
  with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  return paths


def check_tiny(work: str) -> None:
  """Converts a tiny checkpoint with the same names and compares it with the FTW read back."""
  import ml_dtypes  # noqa: PLC0415
  from safetensors.numpy import load_file  # noqa: PLC0415

  from ftjax.formats import ftw  # noqa: PLC0415

  tiny = argparse.Namespace(hidden=64, layers=3, layers_per_shard=2, heads=4, kv_heads=2,
                            head_dim=16, experts=4, ffn=32, vocab=128)
  hf_dir, out = os.path.join(work, "tiny-hf"), os.path.join(work, "tiny-ftw")
  paths = write_checkpoint(tiny, hf_dir, seed=1)
  child = subprocess.run([*PYTHON, CHILD, hf_dir, out, "bfloat16"],
                         capture_output=True, text=True)
  if child.returncode != 0:
    raise RuntimeError(f"tiny conversion failed:\n{child.stderr[-3000:]}")
  model = ftw.FTWFile.open(out)  # checks every CRC-32
  src = {}
  for p in paths:
    src.update(load_file(p))

  def same(a, b):
    return np.array_equal(np.asarray(a, np.float32),
                          b.astype(ml_dtypes.bfloat16).astype(np.float32).reshape(a.shape))

  checks = [("embed_vd", "model.embed_tokens.weight"), ("w_lm_vd", "lm_head.weight"),
            ("layers.2.attn.w_o_dha", "model.layers.2.self_attn.o_proj.weight"),
            ("layers.1.moe.w_router_ed", "model.layers.1.mlp.gate.weight")]
  for ftw_name, hf_name in checks:
    assert same(model.tensor(ftw_name), src[hf_name]), ftw_name
  for layer, expert, part, hf_part in [(0, 0, "gate", "gate_proj"), (2, 3, "down", "down_proj"),
                                       (1, 2, "up", "up_proj")]:
    hf_name = f"model.layers.{layer}.mlp.experts.{expert}.{hf_part}.weight"
    assert same(model.expert_part(layer, expert, part), src[hf_name]), hf_name
  assert len(model.tensor_names()) == 3 + 9 * tiny.layers, model.tensor_names()
  shutil.rmtree(hf_dir)
  shutil.rmtree(out)


# --- measurements -------------------------------------------------------------------------


def dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def sync() -> None:
  subprocess.run(["sync"], check=True)


def convert_once(hf_dir: str, out: str, interval_s: float, log_path: str) -> dict:
  """One conversion in a child process, its memory sampled from /proc every interval_s."""
  sync()
  peak = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0, "VmRSS": 0}
  timeline = []  # (seconds, RssAnon MiB, RssFile MiB), every ~0.1 s, for the JSON
  with open(log_path, "w") as log:
    start = time.perf_counter()
    child = subprocess.Popen([*PYTHON, CHILD, hf_dir, out, "bfloat16"],
                             stdout=subprocess.PIPE, stderr=log, text=True)
    samples, last_kept = 0, -1.0
    while child.poll() is None:
      s = read_status(child.pid)
      if s is not None:
        samples += 1
        for k in peak:
          peak[k] = max(peak[k], s.get(k, 0))
        now = time.perf_counter() - start
        if now - last_kept >= 0.1:
          timeline.append((round(now, 2), round(s["RssAnon"] / MIB, 1),
                           round(s["RssFile"] / MIB, 1)))
          last_kept = now
      time.sleep(interval_s)
    wall = time.perf_counter() - start
    stdout = child.stdout.read()
  if child.returncode != 0:
    with open(log_path) as f:
      raise RuntimeError(f"conversion failed ({child.returncode}):\n{f.read()[-3000:]}")
  report = json.loads(stdout.strip().splitlines()[-1])
  return {
      "convert_s": report["convert_s"], "child_wall_s": wall, "samples": samples,
      "peak_rss_anon": peak["RssAnon"], "peak_rss_file": peak["RssFile"],
      "peak_rss_shmem": peak["RssShmem"], "peak_vm_rss_sampled": peak["VmRSS"],
      "vm_hwm": report["after"]["VmHWM"],  # kernel's exact high-water mark of VmRSS
      "rss_anon_after_import": report["before"]["RssAnon"],
      "rss_file_after_import": report["before"]["RssFile"],
      "peak_rss_anon_above_import": peak["RssAnon"] - report["before"]["RssAnon"],
      "peak_rss_file_above_import": peak["RssFile"] - report["before"]["RssFile"],
      "output_bytes": dir_bytes(out), "timeline": timeline,
  }


def cp_once(shards: list[str], dst: str) -> dict:
  """The peer: cp of the same shards (page cache to page cache), then fsync of the copies."""
  sync()
  os.makedirs(dst)
  start = time.perf_counter()
  subprocess.run(["cp", *shards, dst], check=True)
  cp_s = time.perf_counter() - start
  copies = [os.path.join(dst, os.path.basename(p)) for p in shards]
  subprocess.run(["sync", *copies], check=True)  # coreutils sync FILE... fsyncs those files
  cp_sync_s = time.perf_counter() - start
  start = time.perf_counter()  # and the read alone: the ceiling for any reader of the shards
  subprocess.run(f"cat {' '.join(shards)} > /dev/null", shell=True, check=True)
  return {"cp_s": cp_s, "cp_sync_s": cp_sync_s, "read_s": time.perf_counter() - start}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--layers_per_shard", type=int, default=2)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv_heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--experts", type=int, default=64)
  parser.add_argument("--ffn", type=int, default=512, help="moe_intermediate_size")
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1, help="untimed conversion + cp pairs")
  parser.add_argument("--interval_s", type=float, default=0.02)
  parser.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args()

  t0 = time.perf_counter()
  work = tempfile.mkdtemp(prefix="ftjax-convert-bench-", dir=args.tmp)
  try:
    print(f"scratch: {work}", flush=True)
    check_tiny(work)
    print("tiny checkpoint: every tensor name converts, values match after bfloat16 rounding",
          flush=True)

    hf_dir = os.path.join(work, "hf")
    t = time.perf_counter()
    shards = write_checkpoint(args, hf_dir)
    ckpt = sum(os.path.getsize(p) for p in shards)
    gen_s = time.perf_counter() - t
    print(f"checkpoint: {len(shards)} shards, {ckpt / GB:.3f} GB float32, written in {gen_s:.1f} s",
          flush=True)
    subprocess.run(f"cat {' '.join(shards)} > /dev/null", shell=True, check=True)

    runs, log = [], os.path.join(work, "convert.log")
    for i in range(args.warmup + args.repeats):
      warm = i < args.warmup
      conv = convert_once(hf_dir, os.path.join(work, "ftw"), args.interval_s, log)
      shutil.rmtree(os.path.join(work, "ftw"))
      cp = cp_once(shards, os.path.join(work, "cp"))
      shutil.rmtree(os.path.join(work, "cp"))
      run = {**conv, **cp, "convert_GBps": ckpt / GB / conv["convert_s"],
             "cp_GBps": ckpt / GB / cp["cp_s"], "cp_sync_GBps": ckpt / GB / cp["cp_sync_s"],
             "read_GBps": ckpt / GB / cp["read_s"]}
      for peer in ("cp", "cp_sync", "read"):
        run[f"ratio_to_{peer}"] = run["convert_GBps"] / run[f"{peer}_GBps"]
      run["peak_rss_anon_over_checkpoint"] = conv["peak_rss_anon"] / ckpt
      label = "warmup" if warm else f"run {i - args.warmup + 1}"
      print(f"{label}: convert {conv['convert_s']:.2f} s "
            f"({run['convert_GBps']:.2f} GB/s), cp {cp['cp_s']:.2f} s ({run['cp_GBps']:.2f} GB/s), "
            f"peak RssAnon {conv['peak_rss_anon'] / MIB:.0f} MiB, "
            f"peak RssFile {conv['peak_rss_file'] / MIB:.0f} MiB", flush=True)
      if not warm:
        runs.append(run)

    def med(key):
      return statistics.median(r[key] for r in runs)

    median = {k: med(k) for k in (
        "convert_s", "child_wall_s", "cp_s", "cp_sync_s", "read_s", "convert_GBps", "cp_GBps",
        "cp_sync_GBps", "read_GBps", "ratio_to_cp", "ratio_to_cp_sync", "ratio_to_read",
        "peak_rss_anon", "peak_rss_anon_above_import",
        "rss_anon_after_import", "peak_rss_file", "peak_rss_file_above_import",
        "rss_file_after_import", "vm_hwm", "peak_rss_anon_over_checkpoint")}
    median["peak_rss_file_over_checkpoint"] = median["peak_rss_file"] / ckpt
    median["peak_rss_anon_above_import_over_checkpoint"] = (
        median["peak_rss_anon_above_import"] / ckpt)
    median["peak_rss_file_above_import_over_checkpoint"] = (
        median["peak_rss_file_above_import"] / ckpt)
    out_bytes = runs[0]["output_bytes"]

    def time_rate(key):
      return f"{median[key + '_s']:.2f} s / {median[key + '_GBps']:.2f} GB/s"

    rows = [
        ("checkpoint (float32 safetensors)", f"{ckpt / GB:.3f} GB"),
        ("output (FTW bfloat16)", f"{out_bytes / GB:.3f} GB"),
        ("convert_hf time / GB/s", time_rate("convert")),
        ("child process wall (with imports)", f"{median['child_wall_s']:.2f} s"),
        ("cp time / GB/s (peer)", time_rate("cp")),
        ("cp + fsync of copies", time_rate("cp_sync")),
        ("cat > /dev/null (read only)", time_rate("read")),
        ("convert GB/s : cp GB/s", f"{median['ratio_to_cp']:.2f}"),
        ("convert GB/s : cp+fsync GB/s", f"{median['ratio_to_cp_sync']:.2f}"),
        ("convert GB/s : read GB/s", f"{median['ratio_to_read']:.2f}"),
        ("peak RssAnon", f"{median['peak_rss_anon'] / MIB:.0f} MiB "
         f"({median['peak_rss_anon_over_checkpoint']:.3f} x checkpoint)"),
        ("  RssAnon after `import ftjax`", f"{median['rss_anon_after_import'] / MIB:.0f} MiB"),
        ("  peak RssAnon above that", f"{median['peak_rss_anon_above_import'] / MIB:.0f} MiB "
         f"({median['peak_rss_anon_above_import_over_checkpoint']:.3f} x checkpoint)"),
        ("peak RssFile (mapped, reclaimable)", f"{median['peak_rss_file'] / MIB:.0f} MiB "
         f"({median['peak_rss_file_over_checkpoint']:.3f} x checkpoint)"),
        ("  RssFile after `import ftjax`", f"{median['rss_file_after_import'] / MIB:.0f} MiB"),
        ("  peak RssFile above that", f"{median['peak_rss_file_above_import'] / MIB:.0f} MiB "
         f"({median['peak_rss_file_above_import_over_checkpoint']:.3f} x checkpoint)"),
        ("VmHWM (kernel peak RSS)", f"{median['vm_hwm'] / MIB:.0f} MiB"),
    ]
    print(f"\nmedians of {len(runs)} runs (page cache warm for both; sync before each):")
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
      print(f"  {name:<{width}}  {value}")

    result = {
        "benchmark": "convert_memory",
        "description": "ftjax.convert_hf(dtype='bfloat16') of a synthetic float32 Qwen3-MoE "
                       "checkpoint in a child process, /proc/<pid>/status sampled; peer: cp of "
                       "the same shards on the same filesystem (cp_sync: plus fsync of the copies; "
                       "read: cat of the shards to /dev/null). Source read from page cache by "
                       "both (checkpoint cat to /dev/null first); sync before each timed step. "
                       "GB/s = source bytes / seconds (1 GB = 1e9 B).",
        "machine": machine_info(),
        "checkpoint": {"config": hf_config(args), "shards": len(shards), "bytes": ckpt,
                       "dtype": "float32", "generate_s": gen_s},
        "output_bytes": out_bytes,
        "sample_interval_s": args.interval_s,
        "warmup_runs": args.warmup,
        "median": median,
        "runs": runs,
        "benchmark_wall_s": time.perf_counter() - t0,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
    print(f"\nwrote {args.out} (benchmark wall {result['benchmark_wall_s']:.0f} s)")
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
