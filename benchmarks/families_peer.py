"""The frontier families beside llama.cpp on the same random weights (issue 53): 4-layer models at
the full width of MiniMax-M2, GLM-4.5-Air and DeepSeek-V3 (multi-head latent attention), bf16 on
both sides, decode and 512-token prefill.

Each model is its release's ``config.json`` (``configs/models/``) at 4 decoder layers, with
fewer routed experts per layer so that three of them fit this machine's disk and memory one
after the other. A decode step reads top_k experts per layer whatever the pool, so the bytes a
token reads are the release's at 4 layers; a 512-token prefill touches a larger share of a
smaller pool than it would of the real one. What differs from the release, per model:

  minimax-m2   16 experts per layer (256)
  glm-4.5-air  16 experts per layer (128); the first layer dense, as released
  deepseek-v3  8 experts per layer (256), so top-8 takes all of them and routing in groups
               has nothing to choose (n_group 1); the first layer dense (3 in the release), so
               that 3 of the 4 layers are MoE layers

No MTP layers (``num_nextn_predict_layers`` 0). Random bf16 weights are written by this script
(a Hugging Face checkpoint in the layout each family ships: MiniMax's ``block_sparse_moe`` and
``w1/w2/w3``, GLM's and DeepSeek's ``mlp.experts.{e}`` and ``mlp.gate.e_score_correction_bias``),
then converted by both sides: ftjax's ``convert_hf`` (bf16) and llama.cpp's
``convert_hf_to_gguf.py --outtype bf16`` (its ``minimax-m2``, ``glm4moe`` and ``deepseek2``
architectures). The stand-in tokenizer is the default model's (``../shared/PEERS.md``).

Rounds alternate the sides (``--rounds``, medians): llama-bench ``-p 0 -n 64`` (decode) and
``-p 512 -n 0`` (prefill), 2 threads, weights in its own memory (``-lm none``); ftjax in a worker
process (default kernels, ``auto``), 64 greedy tokens after an 8-token prompt and a 512-token
prompt, and the machine's read bandwidth (``read_probe`` over every layer's experts, the best of
3 passes) for the decode roofline. Each family's files are removed after it is measured (``--keep`` keeps them).

  python benchmarks/families_peer.py --llama_src SRC --llama_build BUILD [--rounds 3]
      [--families minimax-m2,glm-4.5-air,deepseek-v3] [--update]

Results: ``benchmarks/results/families_peer.json`` (machine and ISA included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from cpu_peer import (DECODE_TOKENS, RoundWorker, check_llama_args, convert_gguf,  # noqa: E402
                      llama_bench, serve_rounds, write_config_and_tokenizer,
                      write_random_safetensors)
from hybrid_e2e import contended, with_other_load  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models")
LAYERS = 4
# name -> (config file, the changes for this bench: see the module docstring)
FAMILIES = {
    "minimax-m2": ("minimax-m2.json", {"num_local_experts": 16}),
    "glm-4.5-air": ("glm-4.5-air.json", {"n_routed_experts": 16}),
    "deepseek-v3": ("deepseek-v3.json", {"n_routed_experts": 8, "n_group": 1, "topk_group": 1,
                                         "first_k_dense_replace": 1}),
}
GOALS = {"decode": 1.0, "prefill_512": 1.2}


def log(msg: str) -> None:
  print(f"[families_peer] {msg}", file=sys.stderr, flush=True)


# -- The checkpoints ----------------------------------------------------------------------------

def bench_config(name: str) -> dict:
  """The release's config.json at LAYERS layers, bf16, no MTP, with the bench's changes."""
  file, changes = FAMILIES[name]
  with open(os.path.join(CONFIGS, file)) as f:
    hf = json.load(f)
  hf.pop("quantization_config", None)  # written in bf16, not FP8
  hf.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=0, torch_dtype="bfloat16",
            **changes)
  if "attn_type_list" in hf:
    hf["attn_type_list"] = hf["attn_type_list"][:LAYERS]
  if hf["model_type"] == "minimax_m2":
    hf["mtp_transformer_layers"], hf["use_mtp"], hf["num_mtp_modules"] = 0, False, 0
  hf.update(bos_token_id=0, eos_token_id=1)
  return hf


def hf_tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
  """Tensor name -> shape, in the layout the family's checkpoints ship."""
  kind = hf["model_type"]
  d, v, h = hf["hidden_size"], hf["vocab_size"], hf["num_attention_heads"]
  experts = hf.get("num_local_experts") or hf["n_routed_experts"]
  f = hf.get("moe_intermediate_size") or hf["intermediate_size"]
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d)}
  first_dense = int(hf.get("first_k_dense_replace") or 0)
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    if kind == "deepseek_v3":
      q, r, rope = hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
      nope, vd = hf["qk_nope_head_dim"], hf["v_head_dim"]
      shapes.update({
          p + "self_attn.q_a_proj.weight": (q, d), p + "self_attn.q_a_layernorm.weight": (q,),
          p + "self_attn.q_b_proj.weight": (h * (nope + rope), q),
          p + "self_attn.kv_a_proj_with_mqa.weight": (r + rope, d),
          p + "self_attn.kv_a_layernorm.weight": (r,),
          p + "self_attn.kv_b_proj.weight": (h * (nope + vd), r),
          p + "self_attn.o_proj.weight": (d, h * vd)})
    else:
      a, g = hf["head_dim"], hf["num_key_value_heads"]
      shapes.update({p + "self_attn.q_proj.weight": (h * a, d),
                     p + "self_attn.k_proj.weight": (g * a, d),
                     p + "self_attn.v_proj.weight": (g * a, d),
                     p + "self_attn.o_proj.weight": (d, h * a)})
      if kind == "minimax_m2":
        shapes.update({p + "self_attn.q_norm.weight": (h * a,),
                       p + "self_attn.k_norm.weight": (g * a,)})
      if hf.get("attention_bias"):
        shapes.update({p + "self_attn.q_proj.bias": (h * a,), p + "self_attn.k_proj.bias": (g * a,),
                       p + "self_attn.v_proj.bias": (g * a,)})
    if kind == "minimax_m2":
      m = p + "block_sparse_moe."
      shapes.update({m + "gate.weight": (experts, d), m + "e_score_correction_bias": (experts,)})
      for e in range(experts):
        shapes.update({f"{m}experts.{e}.w1.weight": (f, d), f"{m}experts.{e}.w3.weight": (f, d),
                       f"{m}experts.{e}.w2.weight": (d, f)})
      continue
    if i < first_dense:
      inner = hf["intermediate_size"]
      shapes.update({p + "mlp.gate_proj.weight": (inner, d), p + "mlp.up_proj.weight": (inner, d),
                     p + "mlp.down_proj.weight": (d, inner)})
      continue
    shared = f * int(hf.get("n_shared_experts") or 0)
    shapes.update({p + "mlp.gate.weight": (experts, d),
                   p + "mlp.gate.e_score_correction_bias": (experts,),
                   p + "mlp.shared_experts.gate_proj.weight": (shared, d),
                   p + "mlp.shared_experts.up_proj.weight": (shared, d),
                   p + "mlp.shared_experts.down_proj.weight": (d, shared)})
    for e in range(experts):
      q = f"{p}mlp.experts.{e}."
      shapes.update({q + "gate_proj.weight": (f, d), q + "up_proj.weight": (f, d),
                     q + "down_proj.weight": (d, f)})
  return shapes


def write_checkpoint(name: str, out_dir: str, seed: int = 0) -> str:
  """Random bf16 weights (``cpu_peer.write_random_safetensors``), the config and the stand-in
  tokenizer. Skipped when already there."""
  hf = bench_config(name)
  marker = os.path.join(out_dir, "written.json")
  stamp = {"config": hf, "seed": seed, "format": 1}
  if os.path.exists(marker) and json.load(open(marker)) == stamp:
    return out_dir
  shutil.rmtree(out_dir, ignore_errors=True)
  os.makedirs(out_dir)
  log(f"{name}: the checkpoint")
  write_random_safetensors(out_dir, hf_tensor_shapes(hf), seed)
  write_config_and_tokenizer(out_dir, hf)
  if hf["model_type"] == "glm4_moe":
    add_special_tokens(out_dir, GLM_SPECIAL_TOKENS)
  with open(marker, "w") as f:
    json.dump(stamp, f)
  return out_dir


# llama.cpp's GLM vocabulary reader looks these up among the tokenizer's added tokens.
GLM_SPECIAL_TOKENS = ("<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>")


def add_special_tokens(out_dir: str, tokens: tuple[str, ...]) -> None:
  """Adds ``tokens`` to the stand-in tokenizer as special added tokens, after its vocabulary."""
  path = os.path.join(out_dir, "tokenizer.json")
  with open(path) as f:
    tok = json.load(f)
  added = tok.setdefault("added_tokens", [])
  have = {t["content"] for t in added}
  ids = [t["id"] for t in added] + list(tok["model"]["vocab"].values())
  for text in (t for t in tokens if t not in have):
    ids.append(max(ids) + 1)
    added.append({"id": ids[-1], "content": text, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True})
  with open(path, "w") as f:
    json.dump(tok, f)


# -- ftjax side (a worker process) ----------------------------------------------------------------

def read_gb_s_all(bank) -> float:
  """``read_probe`` over every layer's expert blocks in a row (GB/s), after one pass."""
  from ftjax.kernels import read_probe  # noqa: PLC0415
  layers = [bank[i] for i in range(bank.shape[0])]
  for layer in layers:
    read_probe(layer).block_until_ready()
  t = time.perf_counter()
  for layer in layers:
    read_probe(layer).block_until_ready()
  return sum(x.nbytes for x in layers) / (time.perf_counter() - t) / 1e9


def worker(ftw_dir: str) -> None:
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  model = ftjax.load(ftw_dir, verify=False, populate=True)
  log(f"ftjax worker: {model.config.model_type} loaded ({model.storage.residency}) in "
      f"{time.perf_counter() - t0:.1f} s")
  engine = ftjax.Engine(model, max_seq_len=1024)
  rng = np.random.default_rng(0)
  short = rng.integers(0, model.config.vocab_size, 8)
  long = rng.integers(0, model.config.vocab_size, 512)
  c = model.config
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items() if n != "embed_vd")
  per_token = dense + c.num_decoder_moe_layers * c.top_k * model.expert_bytes

  def measure() -> dict:
    model.storage.populate()
    # The read ceiling: read_probe over every layer's experts, the best of 3 passes (one
    # layer's bank alone read 20.7 GB/s here while decode streamed 25 GB/s).
    read = max(read_gb_s_all(model.bank) for _ in range(3))
    return {"read_GBps": read,
            "decode": engine.generate_timed(short, DECODE_TOKENS + 1).decode_tok_s,
            "prefill_512": engine.generate_timed(long, 1).prefill_tok_s}

  serve_rounds(measure, {"kernels": engine.kernels_path, "bytes_per_token": per_token,
                         "residency": model.storage.residency,
                         "kv_bytes_per_token_layer": c.kv_elements_per_token * 2})


# -- Driver ---------------------------------------------------------------------------------------

def run_family(name: str, args) -> dict:
  import ftjax  # noqa: PLC0415
  work = os.path.join(args.work_dir, name)
  hf_dir = write_checkpoint(name, os.path.join(work, "hf"))
  t0 = time.perf_counter()
  gguf = convert_gguf(hf_dir, args.llama_src, work, "bf16")
  gguf_s = time.perf_counter() - t0
  ftw = os.path.join(work, "ftw")
  t0 = time.perf_counter()
  if not os.path.exists(os.path.join(ftw, "ftw_index.json")):
    ftjax.convert_hf(hf_dir, ftw, dtype="bfloat16", overwrite=True, show_progress=False)
  ftw_s = time.perf_counter() - t0
  if not args.keep:
    shutil.rmtree(hf_dir)  # both conversions are made: free the disk for the rounds
  log(f"{name}: converted (llama.cpp {gguf_s:.0f} s, ftjax {ftw_s:.0f} s)")
  ftjax_worker = RoundWorker(__file__, "--ftw_dir", ftw)
  ready, pid = ftjax_worker.ready, ftjax_worker.proc.pid
  rounds = []
  for r in range(args.rounds):
    row = {}
    for side in (("ftjax", "llama_cpp") if r % 2 == 0 else ("llama_cpp", "ftjax")):
      if side == "ftjax":
        row["ftjax"] = with_other_load(ftjax_worker.ask, pid)
      else:
        row["llama_cpp"] = with_other_load(lambda: {
            "decode": llama_bench(args.llama_build, gguf, "-p", "0", "-n",
                                  str(DECODE_TOKENS))["avg_ts"],
            "prefill_512": llama_bench(args.llama_build, gguf, "-p", "512", "-n", "0")["avg_ts"],
        }, pid)
    ours, theirs = row["ftjax"], row["llama_cpp"]
    row["ratio"] = {k: ours[k] / theirs[k] for k in GOALS}
    row["roofline"] = ours["decode"] * ready["bytes_per_token"] / (ours["read_GBps"] * 1e9)
    rounds.append(row)
    log(f"{name} round {r + 1}/{args.rounds}: ftjax decode {ours['decode']:.2f}, prefill_512 "
        f"{ours['prefill_512']:.1f} ({row['roofline']:.2f} of the roofline at "
        f"{ours['read_GBps']:.1f} GB/s){contended(ours)}; llama.cpp decode "
        f"{theirs['decode']:.2f}, prefill_512 {theirs['prefill_512']:.1f}{contended(theirs)}")
  ftjax_worker.close()
  if not args.keep:
    shutil.rmtree(work)

  def med(fn):
    return statistics.median(fn(r) for r in rounds)

  return {"config": bench_config(name), "ftjax": ready, "conversion_s": {
      "llama_cpp": gguf_s, "ftjax": ftw_s}, "rounds": rounds,
      "medians": {side: {k: med(lambda r, s=side, k=k: r[s][k]) for k in GOALS}
                  for side in ("ftjax", "llama_cpp")},
      "ratio_medians": {k: med(lambda r, k=k: r["ratio"][k]) for k in GOALS},
      "roofline_median": med(lambda r: r["roofline"]),
      "read_GBps_median": med(lambda r: r["ftjax"]["read_GBps"])}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--llama_src", help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
  p.add_argument("--llama_build", help="llama.cpp CMake build dir with bin/llama-bench")
  p.add_argument("--work_dir", default="/tmp/ftjax-families-peer")
  p.add_argument("--families", default=",".join(FAMILIES))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--keep", action="store_true", help="keep the checkpoints and conversions")
  p.add_argument("--update", action="store_true",
                 help="keep the results file's other families (measured earlier on this CPU)")
  p.add_argument("--out", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--ftw_dir", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    worker(args.ftw_dir)
    return
  check_llama_args(p, args)
  names = args.families.split(",")
  unknown = set(names) - set(FAMILIES)
  if unknown:
    p.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
  machine = machine_info()
  log(f"machine: {machine['cpu_model']} (family {machine['cpu_family']} model "
      f"{machine['cpu_model_number']}), kernels {machine['ftjax_kernels']}")
  results = {"benchmark": "families_peer", "command": " ".join(sys.argv), "machine": machine,
             "layers": LAYERS, "decode_tokens": DECODE_TOKENS, "goals": GOALS, "families": {}}
  path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  "families_peer.json")
  if args.update and os.path.exists(path):
    with open(path) as f:
      earlier = json.load(f)
    if earlier["machine"]["cpu_model"] != machine["cpu_model"]:
      p.error(f"--update: {path} was measured on {earlier['machine']['cpu_model']}, not here")
    for name, fam in earlier["families"].items():
      if name not in names:  # kept, with the run that measured it
        results["families"][name] = {**fam, "measured": fam.get("measured", earlier["command"]
                                                                 + " at " + earlier["machine"]["date"])}
  for name in names:
    results["families"][name] = {**run_family(name, args),
                                 "measured": " ".join(sys.argv) + " at " + machine["date"]}
    path = write_results("families_peer", results, path)  # after each family
  print(f"{'family':<12} {'side':<10} {'decode tok/s':>13} {'prefill_512 tok/s':>18}")
  for name, fam in results["families"].items():
    for side in ("ftjax", "llama_cpp"):
      m = fam["medians"][side]
      print(f"{name:<12} {side:<10} {m['decode']:>13.2f} {m['prefill_512']:>18.1f}")
    r = fam["ratio_medians"]
    print(f"{name:<12} {'ratio':<10} {r['decode']:>12.2f}x {r['prefill_512']:>17.2f}x   "
          f"(goals {GOALS['decode']}x, {GOALS['prefill_512']}x; decode at "
          f"{fam['roofline_median']:.2f} of the roofline)")
  print(f"results: {path}")


if __name__ == "__main__":
  main()
