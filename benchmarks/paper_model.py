"""The paper's own model at full depth, in the formats people run, side by side with llama.cpp
(issue 51, item 4).

The model is Qwen3.6-35B-A3B's shape (``qwen3_5_moe``, ``hybrid_e2e.py``'s layer shapes): 40
layers (30 Gated DeltaNet, every fourth full attention), hidden 2048, top-8 experts of width 512
and a shared expert, vocabulary 248,320, untied lm_head, and one MTP layer. The random
checkpoint is written in the Hugging Face layout the way Qwen ships its FP8 release
(``quantization_config.quant_method: fp8``, e4m3 weights with a float32 ``weight_scale_inv`` per
128x128 block): every projection, expert and shared-expert matrix and the MTP ``fc`` in FP8;
the embedding, lm_head, routers, shared-expert gates, DeltaNet ``in_proj_a`` / ``in_proj_b``,
convolutions and norms in bfloat16 (``modules_to_not_convert``). ``--experts`` sets the experts
per layer: 256 is the released model (about 36 GB of FP8); 64 (the default) reads the same bytes
per token (top-8 of them) and lets the checkpoint and every conversion fit this machine's disk
at once.

Each side converts the FP8 checkpoint with its own tools, timed with its peak RSS
(``/usr/bin/time``), the checkpoint read into the page cache first:

  ftjax      ``python -m ftjax.convert --expert_dtype=int4 --dense_dtype=mixed_int4``
             (``--preset int4``, the default: int4 experts and input projections with group
             scales; v, o, the DeltaNet out, the shared down, lm_head and embedding int8), or
             ``--expert_dtype=mxfp4 --dense_dtype=mixed4`` (``--preset mxfp4``: the same with
             MXFP4), read from FP8 streaming.
  llama.cpp  ``convert_hf_to_gguf.py --outtype bf16 --fp8-as-q8 --no-mtp`` (``cpu_peer.py``'s
             patched copy for the stand-in tokenizer), then ``llama-quantize --allow-requantize``
             to Q4_K_M (what CPU users run, about 4.9 bits a weight) and to MXFP4_MOE.

Load to the first token (``full_size.first_token``): each side's server started fresh, seconds
from the process's start to the end of a 1-token completion; cold after dropping the page cache
(root), warm right after; each server's peak RSS (VmHWM). llama.cpp serves Q4_K_M.

Then ``--rounds`` alternating rounds, 2 threads, weights in RAM: ftjax in a worker process
(mapped, pre-faulted before each round; kernels ``auto``), llama.cpp with ``llama-bench -lm
none`` on each GGUF (rerun with ``--repack 0`` where its repacked path crashes, recorded).
Each round measures decode (64 tokens after 8), prefill of 512 and 4096 tokens, and the read
bandwidth (``read_probe`` over one layer's experts), from which each side's decode is also a
fraction of its own roofline (bytes per token / read bandwidth; MTP tensors excluded: a plain
step does not read them). The ftjax worker also times where one decode step's time goes at this
depth (``--step_profile``): the step's programs against the read time of the bytes they read.

  python benchmarks/paper_model.py --llama_src SRC --llama_build BUILD [--rounds 3]

Results: ``benchmarks/results/paper_model.json`` (``--experts 64``) or
``paper_model_256.json`` (``--experts 256 --ftjax_only``). Needs about 45 GB of disk in
``--work_dir`` at 64 experts and 20 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from cpu_peer import RoundWorker, check_llama_args, gguf_converter, serve_rounds  # noqa: E402
from full_size import (ServerExited, drop_caches, evict_from_page_cache,  # noqa: E402
                       first_token, read_into_page_cache, read_into_page_cache_file, timed)
from hybrid_e2e import (DEFAULT_TOKENIZER, contended, hf_config, layer_shapes,  # noqa: E402
                        random_tensor, with_other_load)
from q4_peer import llama_measure  # noqa: E402
from quant_peer import gguf_bytes_per_token  # noqa: E402

LAYERS = 40
THREADS = 2
DECODE_TOKENS = 64
PREFILLS = (512, 4096)
GOALS = {"decode": 1.0, "prefill_512": 1.2, "prefill_4096": 1.2}  # x llama.cpp
ROOFLINE_GOAL = 0.9  # "15 tok/s on a 30 GB/s machine, about 0.9 of the roofline of a 4-bit model"
# ftjax's 4-bit presets (--preset): the FTW directory and the converter's flags. int4 (int4
# experts, mixed_int4 dense) is the one whose quality matches Q4_K_M's (dense_quality.py).
PRESETS = {"int4": ("ftw-int4", ["--expert_dtype=int4", "--dense_dtype=mixed_int4"]),
           "mxfp4": ("ftw-q4", ["--expert_dtype=mxfp4", "--dense_dtype=mixed4"])}
LLAMA_FORMATS = ("Q4_K_M", "MXFP4_MOE")
FP8_BLOCK = [128, 128]
# Kept in bfloat16 by the FP8 release (its modules_to_not_convert): name fragments.
NOT_FP8 = ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate", "in_proj_a.",
           "in_proj_b.")
GENERATOR_VERSION = 1  # bump when write_fp8_checkpoint changes what it writes


def log(msg: str) -> None:
  print(f"[paper_model] {msg}", file=sys.stderr, flush=True)


# -- The FP8 checkpoint ---------------------------------------------------------------------------

def config(experts: int, layers: int = LAYERS) -> dict:
  c = hf_config(layers, num_experts=experts)
  c.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
  c["quantization_config"] = {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": FP8_BLOCK,
      "modules_to_not_convert": ["lm_head", "model.embed_tokens", "mlp.gate",
                                 "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                                 "linear_attn.in_proj_b"]}
  return c


def mtp_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """The MTP head as Qwen3.5/3.6 checkpoints name it: ``mtp.fc`` over [embedding; hidden],
  its norms, and one full-attention MoE decoder layer ``mtp.layers.0.*``."""
  d = c["hidden_size"]
  out = {"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,),
         "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,)}
  full = dict(c, layer_types=["full_attention"])
  for name, shape in layer_shapes(full, 0).items():
    out["mtp." + name[len("model."):]] = shape
  return out


def is_fp8(name: str, shape: tuple[int, ...]) -> bool:
  return len(shape) == 2 and name.endswith(".weight") and not any(k in name for k in NOT_FP8)


def fp8_quantise(w):
  """``w`` (bfloat16 [R, C], both multiples of 128) as e4m3 and its float32 block scales, the
  way transformers' ``Fp8Quantize`` writes them: scale_inv = max|block| / 448."""
  import torch  # noqa: PLC0415
  (r, c), (bm, bn) = w.shape, FP8_BLOCK
  if r % bm or c % bn:
    raise ValueError(f"{tuple(w.shape)} is not a multiple of the {FP8_BLOCK} block")
  blocks = w.float().reshape(r // bm, bm, c // bn, bn)
  amax = blocks.abs().amax(dim=(1, 3))
  scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
  q = (blocks / scale[:, None, :, None]).reshape(r, c).to(torch.float8_e4m3fn)
  return q, scale.float()


def generator_stamp(experts: int, layers: int, seed: int) -> dict:
  return {"generator": "benchmarks/paper_model.py", "version": GENERATOR_VERSION,
          "experts": experts, "layers": layers, "seed": seed}


def write_fp8_checkpoint(out_dir: str, experts: int, layers: int = LAYERS, seed: int = 0) -> str:
  """The random FP8 checkpoint in ``out_dir`` (kept while its generator stamp matches): one
  shard per layer, one for the embedding, norm and lm_head, one for the MTP head."""
  import torch  # noqa: PLC0415
  from safetensors.torch import save_file  # noqa: PLC0415
  stamp = generator_stamp(experts, layers, seed)
  try:
    with open(os.path.join(out_dir, "generator.json")) as f:
      if json.load(f) == stamp:
        return out_dir
  except (OSError, ValueError):
    pass
  c = config(experts, layers)
  tmp = out_dir + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  gen = torch.Generator().manual_seed(seed)
  v, d = c["vocab_size"], c["hidden_size"]
  groups = ([{"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}] + [layer_shapes(c, i) for i in range(layers)]
            + [mtp_shapes(c)])
  names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
  weight_map, total = {}, 0
  t0 = time.perf_counter()
  for i, (shard, shapes) in enumerate(zip(names, groups)):
    tensors = {}
    for n, s in shapes.items():
      t = random_tensor(n, s, gen)
      if is_fp8(n, s):
        tensors[n], tensors[n + "_scale_inv"] = fp8_quantise(t)
      else:
        tensors[n] = t
    save_file(tensors, os.path.join(tmp, shard), metadata={"format": "pt"})
    total += sum(t.nbytes for t in tensors.values())
    weight_map.update(dict.fromkeys(tensors, shard))
    del tensors
    log(f"  wrote {shard} ({i + 1}/{len(groups)}, {total / 1e9:.1f} GB, "
        f"{time.perf_counter() - t0:.0f} s)")
  with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(c, f, indent=2)
  shutil.copy(DEFAULT_TOKENIZER, os.path.join(tmp, "tokenizer.json"))
  with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
  with open(os.path.join(tmp, "generator.json"), "w") as f:
    json.dump(stamp, f)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.rename(tmp, out_dir)
  return out_dir


# -- Conversions ----------------------------------------------------------------------------------

def dir_bytes(path: str) -> int:
  if os.path.isfile(path):
    return os.path.getsize(path)
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def convert_all(hf_dir: str, work_dir: str, args) -> tuple[str, dict[str, str], dict]:
  """ftjax's and llama.cpp's conversions, each timed once (kept while newer than the
  checkpoint; a kept one reports the timing recorded when it was made)."""
  record_path = os.path.join(work_dir, "conversions.json")
  try:
    with open(record_path) as f:
      record = json.load(f)
  except (OSError, ValueError):
    record = {}
  stamp = os.path.getmtime(os.path.join(hf_dir, "generator.json"))

  def fresh(path: str) -> bool:
    return os.path.exists(path) and os.path.getmtime(path) > stamp and \
        os.path.basename(path) in record

  def save() -> None:
    with open(record_path, "w") as f:
      json.dump(record, f, indent=1)

  name, flags = PRESETS[args.preset]
  ftw = os.path.join(work_dir, name)
  if not fresh(ftw):
    evict_others(hf_dir, work_dir)
    read_into_page_cache(hf_dir)
    log(f"ftjax.convert {' '.join(flags)} -> {ftw}")
    record[name] = timed([sys.executable, "-m", "ftjax.convert", f"--hf_dir={hf_dir}",
                          f"--out={ftw}", "--overwrite", *flags], cwd="/tmp")
    record[name]["command"] = f"python -m ftjax.convert {' '.join(flags)}"
    save()
    log(f"  {record[name]}")
  ggufs = {}
  if not args.ftjax_only:
    base = os.path.join(work_dir, "model-fp8-q8.gguf")
    if not fresh(base):
      script, env, cwd = gguf_converter(args.llama_src, work_dir)
      evict_others(hf_dir, work_dir)
      read_into_page_cache(hf_dir)
      log(f"convert_hf_to_gguf.py --outtype bf16 --fp8-as-q8 --no-mtp -> {base}")
      record[os.path.basename(base)] = timed(
          [sys.executable, script, hf_dir, "--outtype", "bf16", "--fp8-as-q8", "--no-mtp",
           "--outfile", base + ".partial"], env=env, cwd=cwd)
      os.replace(base + ".partial", base)
      save()
      log(f"  {record[os.path.basename(base)]}")
    for kind in LLAMA_FORMATS:
      out = os.path.join(work_dir, f"model-{kind}.gguf")
      if not (os.path.exists(out) and os.path.getmtime(out) > os.path.getmtime(base)
              and os.path.basename(out) in record):
        log(f"llama-quantize --allow-requantize {kind} -> {out}")
        try:
          record[os.path.basename(out)] = timed(
              [os.path.join(args.llama_build, "bin", "llama-quantize"), "--allow-requantize",
               base, out + ".partial", kind, str(THREADS)])
        except subprocess.CalledProcessError as e:
          log(f"llama-quantize {kind} failed ({e.returncode}); leaving it out")
          continue
        os.replace(out + ".partial", out)
        save()
        log(f"  {record[os.path.basename(out)]}")
      ggufs[kind] = out
  conversions = {name: dict(r, bytes=dir_bytes(os.path.join(work_dir, name)))
                 for name, r in record.items() if os.path.exists(os.path.join(work_dir, name))}
  return ftw, ggufs, conversions


def evict_others(keep: str, work_dir: str) -> None:
  """Every file of ``work_dir`` (and the checkpoint, unless kept) out of the page cache."""
  for name in os.listdir(work_dir):
    path = os.path.join(work_dir, name)
    if path != keep and (os.path.isfile(path) or os.path.isdir(path)):
      evict_from_page_cache(path)


# -- ftjax side (a worker process) ----------------------------------------------------------------

def ftjax_bytes_per_token(model) -> int:
  """The FTW's dense tensors but the embedding and the MTP head, plus top_k experts per
  (non-MTP) MoE layer: what one plain decode step reads."""
  c = model.config
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items()
              if n != "embed_vd" and not n.startswith("mtp."))
  return dense + c.num_layers * c.top_k * model.expert_bytes


def read_gb_s_layers(banks) -> float:
  """The machine's read bandwidth now: ``read_probe`` over several layers' expert banks in a
  row (one layer of 64 MXFP4 experts is 53 MB, near the size of a server's L3), the second of
  two passes."""
  from ftjax.kernels import read_probe  # noqa: PLC0415
  for b in banks:
    read_probe(b).block_until_ready()
  t = time.perf_counter()
  for b in banks:
    read_probe(b).block_until_ready()
  return sum(b.nbytes for b in banks) / (time.perf_counter() - t) / 1e9


def step_profile(engine, model, prompt, read_gbps: float) -> dict:
  """Where one decode step's time goes at full depth: the step's wall time (median of 32)
  against the read time of what it reads, and the same step with the experts and the dense
  weights apart (``jax.profiler`` is not needed: the difference to the read time is what runs
  outside the kernels' streaming: FFI call overheads, XLA's small ops, state updates)."""
  result = engine.generate_timed(prompt, 33)
  step = result.decode_s / 32
  per_token = ftjax_bytes_per_token(model)
  read_s = per_token / (read_gbps * 1e9)
  return {"step_ms": step * 1e3, "read_ms": read_s * 1e3,
          "outside_reads_ms": (step - read_s) * 1e3, "programs": result.programs}


def worker(ftw_dir: str, prefills: list[int]) -> None:
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  # Mapped, not copied: llama-bench reads its GGUF into its own memory between our rounds.
  model = ftjax.load(ftw_dir, verify=False, populate=True, load_mode="mmap")
  log(f"ftjax worker: loaded (dense {model.dense_formats}, experts {model.expert_format}) in "
      f"{time.perf_counter() - t0:.1f} s")
  engine = ftjax.Engine(model, max_seq_len=max(prefills) + DECODE_TOKENS + 64)
  rng = np.random.default_rng(0)
  short = rng.integers(0, model.config.vocab_size, 8)
  long = rng.integers(0, model.config.vocab_size, max(prefills))
  probe = [model.bank[layer] for layer in range(min(8, model.config.num_layers))]

  def measure() -> dict:
    model.storage.populate()
    read = read_gb_s_layers(probe)
    out = {"read_GBps": read}
    out["decode"] = engine.generate_timed(short, DECODE_TOKENS + 1).decode_tok_s
    for n in prefills:
      out[f"prefill_{n}"] = engine.generate_timed(long[:n], 1).prefill_tok_s
    out["step"] = step_profile(engine, model, short, read)
    return out

  serve_rounds(measure, {"kernels": engine.kernels_path, "bytes_per_token":
                         ftjax_bytes_per_token(model), "dense": model.dense_formats,
                         "experts": model.expert_format})


# -- Driver ---------------------------------------------------------------------------------------

def llama_side(build: str, gguf: str, prefills: list[int]) -> dict:
  out, how = {}, {}
  m = llama_measure(build, gguf, "-p", "0", "-n", str(DECODE_TOKENS))
  out["decode"], how["decode"] = m.pop("tok_s"), m
  for n in prefills:
    m = llama_measure(build, gguf, "-p", str(n), "-n", "0")
    out[f"prefill_{n}"], how[f"prefill_{n}"] = m.pop("tok_s"), m
  out["how"] = how
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--llama_src", help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
  p.add_argument("--llama_build", help="llama.cpp CMake build dir with bin/llama-bench, "
                 "llama-quantize and llama-server")
  p.add_argument("--work_dir", default="/tmp/ftjax-paper-model")
  p.add_argument("--experts", type=int, default=64,
                 help="experts per layer (256 = the released model; 64 reads the same bytes "
                      "per token)")
  p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (40; fewer only "
                 "for a smoke run of this script)")
  p.add_argument("--ftjax_only", action="store_true",
                 help="no llama.cpp side (the 256-expert run, whose conversions do not fit)")
  p.add_argument("--prefills", default=",".join(map(str, PREFILLS)))
  p.add_argument("--preset", choices=sorted(PRESETS), default="int4",
                 help="ftjax's 4-bit conversion (int4: int4 experts, mixed_int4 dense)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--skip_loads", action="store_true", help="no load-to-first-token timing")
  p.add_argument("--out", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--ftw_dir", help=argparse.SUPPRESS)
  args = p.parse_args()
  prefills = [int(x) for x in args.prefills.split(",")]
  if args.worker:
    worker(args.ftw_dir, prefills)
    return
  if not args.ftjax_only:
    check_llama_args(p, args)
  machine = machine_info()
  log(f"machine: {machine['cpu_model']} (family {machine['cpu_family']} model "
      f"{machine['cpu_model_number']}), kernels {machine['ftjax_kernels']}")
  work_dir = os.path.join(args.work_dir, f"e{args.experts}-l{args.layers}")
  os.makedirs(work_dir, exist_ok=True)
  t0 = time.perf_counter()
  hf_dir = write_fp8_checkpoint(os.path.join(work_dir, "hf-fp8"), args.experts, args.layers)
  log(f"checkpoint ready ({dir_bytes(hf_dir) / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s")
  ftw, ggufs, conversions = convert_all(hf_dir, work_dir, args)
  log(f"conversions: {json.dumps(conversions)}")
  evict_from_page_cache(hf_dir)

  loads = {}
  if not args.skip_loads:
    first_token("ftjax", ftw, args.llama_build)  # fills the compilation cache: not timed
    servers = [("ftjax", ftw)] + ([("llama_cpp", ggufs["Q4_K_M"])] if "Q4_K_M" in ggufs else [])
    for side, model in servers:
      evict_others(model, work_dir)
      cold_ok = drop_caches()
      extra, how = (), {}
      try:
        cold = first_token(side, model, args.llama_build) if cold_ok else None
      except ServerExited as e:
        # llama.cpp 0.3.36's repacked CPU path dies on this project's AMX Xeon (as llama-bench's
        # does in q4_peer.py): the server runs again without repacking, recorded.
        if side != "llama_cpp" or e.returncode >= 0:
          raise
        extra, how = ("--no-repack",), {"crash": f"signal {-e.returncode} with repacking",
                                        "flags": "--no-repack"}
        evict_others(model, work_dir)
        cold = first_token(side, model, args.llama_build, extra) if drop_caches() else None
      warm = first_token(side, model, args.llama_build, extra)
      loads[side] = {"cold": cold, "warm": warm, **how}
      log(f"{side}: first token cold {cold and round(cold['first_token_s'], 1)} s, warm "
          f"{warm['first_token_s']:.1f} s, peak RSS {warm['peak_rss_bytes'] / 2**30:.2f} GiB")
    evict_others(ftw, work_dir)

  top_k = json.load(open(os.path.join(hf_dir, "config.json")))["num_experts_per_tok"]
  llama_bytes = {k: gguf_bytes_per_token(g, args.llama_src, top_k) for k, g in ggufs.items()}
  ftjax_worker = RoundWorker(__file__, "--ftw_dir", ftw, "--prefills", args.prefills)
  ready, proc = ftjax_worker.ready, ftjax_worker.proc
  log(f"ftjax worker ready: {ready}; llama.cpp bytes per token {llama_bytes}")
  sides = ["ftjax", *ggufs]
  metrics = ["decode", *(f"prefill_{n}" for n in prefills)]
  rounds = []
  for r in range(args.rounds):
    row = {"llama_cpp": {}}
    for side in (sides if r % 2 == 0 else sides[::-1]):
      if side == "ftjax":
        for g in ggufs.values():
          evict_from_page_cache(g)  # then the worker's populate() keeps its own pages
        row["ftjax"] = with_other_load(ftjax_worker.ask, proc.pid)
      else:
        read_into_page_cache_file(ggufs[side])
        row["llama_cpp"][side] = with_other_load(
            lambda g=ggufs[side]: llama_side(args.llama_build, g, prefills), proc.pid)
        evict_from_page_cache(ggufs[side])
    ours, read = row["ftjax"], row["ftjax"]["read_GBps"]
    row["ratio"] = {f"{m}/{k}": ours[m] / v[m] for k, v in row["llama_cpp"].items()
                    for m in metrics}
    row["roofline"] = {"ftjax": ours["decode"] * ready["bytes_per_token"] / 1e9 / read,
                       **{k: v["decode"] * llama_bytes[k] / 1e9 / read
                          for k, v in row["llama_cpp"].items()}}
    rounds.append(row)
    log(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s; ftjax " + ", ".join(
        f"{m} {ours[m]:.1f}" for m in metrics) + f" ({row['roofline']['ftjax']:.2f} of its "
        f"roofline; step {ours['step']['step_ms']:.1f} ms, reads {ours['step']['read_ms']:.1f})"
        + contended(ours) + "".join(
            f"; {k} " + ", ".join(f"{m} {v[m]:.1f}" for m in metrics)
            + f" ({row['roofline'][k]:.2f})" + contended(v) for k, v in row["llama_cpp"].items()))
  ftjax_worker.close()

  def med(fn):
    return statistics.median(fn(r) for r in rounds)

  medians = {"ftjax": {m: med(lambda r, m=m: r["ftjax"][m]) for m in metrics},
             **{k: {m: med(lambda r, k=k, m=m: r["llama_cpp"][k][m]) for m in metrics}
                for k in ggufs}}
  ratio_medians = {k: med(lambda r, k=k: r["ratio"][k]) for k in rounds[0]["ratio"]}
  roofline_medians = {k: med(lambda r, k=k: r["roofline"][k]) for k in rounds[0]["roofline"]}
  read = med(lambda r: r["ftjax"]["read_GBps"])
  results = {
      "benchmark": "paper_model", "command": " ".join(sys.argv), "machine": machine,
      "model": {"shape": "Qwen3.6-35B-A3B (qwen3_5_moe)", "layers": args.layers,
                "experts": args.experts, "top_k": top_k, "mtp_layers": 1,
                "source": "FP8 e4m3, 128x128 block scales (as Qwen ships it)",
                "checkpoint_bytes": dir_bytes(hf_dir)},
      "conversion": conversions, "load_to_first_token": loads,
      "ftjax": {"preset": args.preset, "convert": PRESETS[args.preset][1], "kernels": ready["kernels"], "dense": ready["dense"],
                "experts": ready["experts"], "bytes_per_token": ready["bytes_per_token"]},
      "llama_cpp": {"build": args.llama_build, "flags": f"-t {THREADS} -r 1 -lm none",
                    "formats": {k: {"gguf": f"convert --fp8-as-q8, llama-quantize "
                                            f"--allow-requantize {k}",
                                    "bytes_per_token": llama_bytes[k]} for k in ggufs}},
      "threads": THREADS, "decode_tokens": DECODE_TOKENS, "prefills": prefills,
      "rounds": rounds, "medians": medians, "read_GBps_median": read,
      "ratio_medians": ratio_medians, "roofline_ratio_medians": roofline_medians,
      "step_profile_median": {k: med(lambda r, k=k: r["ftjax"]["step"][k])
                              for k in ("step_ms", "read_ms", "outside_reads_ms")},
      "goals": {**GOALS, "roofline": ROOFLINE_GOAL, "warm_load_ratio_at_most": 1.0},
      "contended_measurements": sum(side["other_load"] > 0.1 for r in rounds
                                    for side in (r["ftjax"], *r["llama_cpp"].values())),
  }
  met = {k: v >= GOALS.get(k.split("/")[0], 1.2) for k, v in ratio_medians.items()}
  met["roofline"] = roofline_medians["ftjax"] >= ROOFLINE_GOAL
  if "ftjax" in loads and "llama_cpp" in loads:
    warm = (loads["ftjax"]["warm"]["first_token_s"]
            / loads["llama_cpp"]["warm"]["first_token_s"])
    results["warm_load_ratio"] = warm
    met["warm_load"] = warm <= 1.0
  results["goals_met"] = met
  for side, m in medians.items():
    print(f"{side:10s} " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in m.items()))
  print("ratios (medians; goals decode 1.0, prefill 1.2): " + ", ".join(
      f"{k} {v:.2f}" for k, v in ratio_medians.items()))
  print(f"of the roofline (read {read:.1f} GB/s; goal 0.9 for ftjax): " + ", ".join(
      f"{k} {v:.2f}" for k, v in roofline_medians.items()))
  if loads:
    print("first token: " + "; ".join(
        f"{s} warm {v['warm']['first_token_s']:.1f} s"
        + (f", cold {v['cold']['first_token_s']:.1f} s" if v["cold"] else "")
        + f", peak RSS {v['warm']['peak_rss_bytes'] / 2**30:.2f} GiB" for s, v in loads.items()))
  name = "paper_model" if args.experts == 64 and not args.ftjax_only else \
      f"paper_model_{args.experts}"
  out = args.out
  if out is None and (args.layers != LAYERS or args.rounds < 3):
    out = os.path.join(work_dir, "paper_model-smoke.json")
  print(f"results: {write_results(name, results, out)}")


if __name__ == "__main__":
  main()
