"""Quality of ftjax's quantised formats on trained weights, against llama.cpp's (issue 51).

The models: the two embedded trained models, ``default`` (``qwen3_moe``) and
``default-hybrid`` (``qwen3_5_moe``), both trained on the Python standard library
(``ftjax/tiny/README.md``). The text: the training split's held-out files
(``ftjax.tiny.train.corpus_files``: CRC-32 of the path 0 mod 20; code the models never saw),
concatenated in order, cut after enough tokens for ``--chunks`` windows of ``--ctx`` tokens,
written to one text file that both engines read.

ftjax (``ftjax.Engine(model, kernels="ffi")``, exact to each format's weights; the two 4-bit
presets also as ``kernels="auto"`` runs them, ``ffi_bf16``; one teacher-forced forward per window): the
bfloat16 model as written, and the model quantised in memory by
``ftjax.runtime.model.quantize_dense`` (``int8``, ``mxfp4``, ``int4``, and the presets
``mixed4`` / ``mixed_int4``: lm_head, embedding, value and output projections int8, the other
linears mxfp4 / int4) and ``quantize_experts`` (``int8``, ``mxfp4``, ``int4``), and whole
presets: 4-bit (dense mixed4 + experts mxfp4; dense mixed_int4 + experts int4) and all int8
(dense int8 + experts int8).
For every variant: mean KL(bf16 || variant) of the next-token distributions, top-1
agreement with bf16, and perplexity of the text.

llama.cpp (``--llama_build``): the same weights exported as a Hugging Face checkpoint (the
hybrid by ``ftw_to_hf.py``, the qwen3_moe model by ``export_qwen3_moe`` below; each checked
to convert back bit for bit with ftjax's own converter), converted by llama.cpp's converter
(the copy whose pre-tokenizer is patched as in ``agent_peer.py``) to BF16 and Q8_0, and
``llama-quantize``'d from BF16 to Q4_K_M and MXFP4_MOE (its fallbacks for rows that are not
multiples of 256 are recorded). ``llama-perplexity -c CTX --kl-divergence-base`` on BF16,
then ``--kl-divergence`` on each: mean KLD, "Same top p", PPL(Q).

Scoring is llama-perplexity's on both sides: consecutive windows of ``--ctx`` tokens from the
start of the text, and in each window only the predictions of positions ctx/2 .. ctx-2 (the
second half, each with at least ctx/2 tokens of context). The tokens llama.cpp scored are read
back from its base file and compared with ftjax's (same text, same tokenizer, llama.cpp's
``gpt-2`` pre-tokenizer); ftjax also reports every position of each window (``all_positions``).
llama.cpp keeps the base log-probabilities as 16-bit values, so its KL has a small floor:
the BF16 file against its own base is reported (``BF16 (self)``). llama-perplexity runs with
``-nr`` (no weight repacking; ``--llama_repack`` turns it back on): on the AMX Xeon VM its
repacked Q8_0 path died with SIGILL and Q4_K_M / MXFP4_MOE with SIGSEGV. A run whose summary
its logger lost at exit is repeated (``perplexity_run``; ``attempts`` in the results).

  /work/venv/bin/python benchmarks/dense_quality.py     # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_peer import gguf_converter  # noqa: E402
from common import machine_info, pyplot, write_results  # noqa: E402
from ftw_to_hf import _to_torch, check_round_trip, export_hf  # noqa: E402

LLAMA_BUILD = "/tmp/llama/build"
LLAMA_SRC = "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
MODELS = {"default": "qwen3_moe", "default-hybrid": "qwen3_5_moe"}
# ftjax variant -> (dense format, expert format); None: as written (bfloat16)
VARIANTS = {
    "bf16": (None, None),
    "dense int8": ("int8", None),
    "dense mxfp4": ("mxfp4", None),
    "dense mixed4": ("mixed4", None),
    "dense int4": ("int4", None),
    "dense mixed_int4": ("mixed_int4", None),
    "experts int8": (None, "int8"),
    "experts mxfp4": (None, "mxfp4"),
    "experts int4": (None, "int4"),
    "4-bit preset (dense mixed4 + experts mxfp4)": ("mixed4", "mxfp4"),
    "4-bit int4 preset (dense mixed_int4 + experts int4)": ("mixed_int4", "int4"),
    "all int8 (dense int8 + experts int8)": ("int8", "int8"),
    "MXFP4_MOE-like (dense int8 + experts mxfp4)": ("int8", "mxfp4"),
    # The 4-bit presets as kernels="auto" runs them: prefill (every forward here) with bf16
    # activations on the bf16-pair GEMM, int4 weights rounded to bf16 there.
    "4-bit preset, auto kernels (ffi_bf16)": ("mixed4", "mxfp4"),
    "4-bit int4 preset, auto kernels (ffi_bf16)": ("mixed_int4", "int4"),
}
# The kernels each variant runs with: "ffi" (exact to the formats' weights) unless named here.
KERNELS = {"4-bit preset, auto kernels (ffi_bf16)": "ffi_bf16",
           "4-bit int4 preset, auto kernels (ffi_bf16)": "ffi_bf16"}
PRESET_4BIT = "4-bit preset (dense mixed4 + experts mxfp4)"
PRESET_INT4 = "4-bit int4 preset (dense mixed_int4 + experts int4)"
ALL_INT8 = "all int8 (dense int8 + experts int8)"
MXFP4_MOE_LIKE = "MXFP4_MOE-like (dense int8 + experts mxfp4)"
LLAMA_TYPES = ("Q8_0", "Q4_K_M", "MXFP4_MOE")  # besides BF16
# The goal of issue 51: (ftjax variant, llama.cpp type it must be no worse than)
GOALS = (("dense mixed4", "Q4_K_M"), ("dense mixed_int4", "Q4_K_M"), (PRESET_4BIT, "Q4_K_M"),
         (PRESET_INT4, "Q4_K_M"), ("4-bit preset, auto kernels (ffi_bf16)", "Q4_K_M"),
         ("4-bit int4 preset, auto kernels (ffi_bf16)", "Q4_K_M"), ("dense int8", "Q8_0"),
         ("experts int8", "Q8_0"), (ALL_INT8, "Q8_0"), (MXFP4_MOE_LIKE, "MXFP4_MOE"))


def log(msg: str) -> None:
  print(f"[dense_quality] {msg}", file=sys.stderr, flush=True)


# -- The text -----------------------------------------------------------------------------------

def heldout_text(tokenizer, tokens: int) -> str:
  """Held-out standard-library files in order, concatenated, until the text has ``tokens``."""
  from ftjax.tiny import train  # noqa: PLC0415
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  text = ""
  for t in train.read_texts(root, held):
    text += t if t.endswith("\n") else t + "\n"
    if len(tokenizer.encode(text)) >= tokens:
      return text
  raise RuntimeError(f"the held-out files have fewer than {tokens} tokens")


def windows(ids: np.ndarray, chunks: int, ctx: int) -> np.ndarray:
  if len(ids) < chunks * ctx:
    raise RuntimeError(f"{len(ids)} tokens, fewer than {chunks} windows of {ctx}")
  return ids[:chunks * ctx].reshape(chunks, ctx)


# -- ftjax --------------------------------------------------------------------------------------

def quantised(model, dense: str | None, experts: str | None) -> tuple[object, str]:
  """The model in (dense, experts) formats and the order the quantisers ran in."""
  from ftjax.runtime.model import quantize_dense, quantize_experts  # noqa: PLC0415
  if dense and experts:
    try:
      return quantize_experts(quantize_dense(model, dense), experts), "dense then experts"
    except Exception as e:  # noqa: BLE001 (reported: the other order is tried)
      log(f"quantize_experts after quantize_dense failed ({type(e).__name__}: {e}); "
          "quantising experts first")
      return (quantize_dense(quantize_experts(model, experts), dense),
              f"experts then dense (dense then experts raised {type(e).__name__}: {e})")
  if dense:
    return quantize_dense(model, dense), "dense"
  if experts:
    return quantize_experts(model, experts), "experts"
  return model, "none"


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ftjax_logprobs(model, win: np.ndarray, batch: int, kernels: str = "ffi") -> np.ndarray:
  """log-softmax of the teacher-forced logits, [chunks, ctx - 1, V] (position j predicts
  token j + 1), in float32."""
  import ftjax  # noqa: PLC0415
  engine = ftjax.Engine(model, kernels=kernels, max_seq_len=win.shape[1])
  out = []
  try:
    for i in range(0, len(win), batch):
      logits = engine.forward_logits(win[i:i + batch])  # [B, T, V]
      out.append(log_softmax(logits[:, :-1]).astype(np.float32))
  finally:
    engine.close()
  return np.concatenate(out)


def metrics(base: np.ndarray, var: np.ndarray, targets: np.ndarray) -> dict:
  """Mean KL(base || var), top-1 agreement and perplexity over the positions given."""
  p = np.exp(base.astype(np.float64))
  kl = (p * (base.astype(np.float64) - var.astype(np.float64))).sum(-1)
  nll = -np.take_along_axis(var, targets[..., None], -1)[..., 0].astype(np.float64)
  same = base.argmax(-1) == var.argmax(-1)
  n = kl.size
  return {"kl": float(kl.mean()), "kl_stderr": float(kl.std() / np.sqrt(n)),
          "kl_p99": float(np.quantile(kl, 0.99)), "top1_agree": float(same.mean()),
          "ppl": float(np.exp(nll.mean())), "positions": int(n)}


def ftjax_side(model_name: str, win: np.ndarray, batch: int) -> dict:
  import ftjax  # noqa: PLC0415
  model = ftjax.load(model_name)
  ctx = win.shape[1]
  first = ctx // 2
  targets = win[:, 1:]  # [chunks, ctx - 1]
  rows, base = {}, None
  for name, (dense, experts) in VARIANTS.items():
    t0 = time.perf_counter()
    m, order = quantised(model, dense, experts)
    lp = ftjax_logprobs(m, win, batch, KERNELS.get(name, "ffi"))
    if base is None:
      base = lp
    half = metrics(base[:, first:], lp[:, first:], targets[:, first:])
    rows[name] = dict(half, dense=dense or "bfloat16", experts=experts or "bfloat16",
                      kernels=KERNELS.get(name, "ffi"), quantise_order=order, all_positions=metrics(base, lp, targets),
                      seconds=round(time.perf_counter() - t0, 1))
    log(f"{model_name} ftjax {name}: KL {half['kl']:.5f}, top-1 {half['top1_agree']:.4f}, "
        f"PPL {half['ppl']:.3f} ({rows[name]['seconds']} s; {order})")
    del m, lp
  return rows


# -- The Hugging Face checkpoints ---------------------------------------------------------------

def export_qwen3_moe(ftw_dir: str, hf_dir: str) -> str:
  """The ``qwen3_moe`` FTW model as a Hugging Face ``Qwen3MoeForCausalLM`` checkpoint: dense
  tensors reshaped to the HF shapes as ``ftjax.formats.hf`` reads them (no transposes; plain
  RMSNorm weights as stored), experts per expert, the tokenizer files copied."""
  from safetensors.torch import save_file  # noqa: PLC0415

  from ftjax.formats import ftw  # noqa: PLC0415
  from ftjax.formats.hf import TOKENIZER_FILES  # noqa: PLC0415
  f = ftw.FTWFile.open(ftw_dir, verify=False)
  c = f.config
  if c.model_type != "qwen3_moe" or c.shared_expert_intermediate_size or c.norm_zero_centred:
    raise ValueError(f"{ftw_dir}: not a plain qwen3_moe model")
  top = {"embed_vd": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight",
         "w_lm_vd": "lm_head.weight"}
  layer = {"attn_norm.scale": "input_layernorm.weight",
           "mlp_norm.scale": "post_attention_layernorm.weight",
           "attn.w_q_had": "self_attn.q_proj.weight", "attn.w_k_gad": "self_attn.k_proj.weight",
           "attn.w_v_gad": "self_attn.v_proj.weight", "attn.w_o_dha": "self_attn.o_proj.weight",
           "attn.q_norm.scale": "self_attn.q_norm.weight",
           "attn.k_norm.scale": "self_attn.k_norm.weight", "moe.w_router_ed": "mlp.gate.weight"}
  tensors = {}
  for name in f.tensor_names():
    value = f.tensor(name)
    if name in top:
      tensors[top[name]] = value
      continue
    m = re.match(r"layers\.(\d+)\.(.+)$", name)
    if m is None or m[2] not in layer:
      raise ValueError(f"tensor {name} has no qwen3_moe Hugging Face name")
    hf = f"model.layers.{m[1]}.{layer[m[2]]}"
    if value.ndim == 3:  # [H, A, D] -> [H·A, D]; o: [D, H, A] -> [D, H·A]
      value = value.reshape(-1, value.shape[2]) if m[2] != "attn.w_o_dha" else value.reshape(
          value.shape[0], -1)
    tensors[hf] = value
  for i in range(c.num_layers):
    for e in range(c.num_experts):
      for part, hf_part in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        tensors[f"model.layers.{i}.mlp.experts.{e}.{hf_part}.weight"] = f.expert_part(i, e, part)
  config = {
      "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
      "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
      "num_experts": c.num_experts, "num_experts_per_tok": c.top_k,
      "moe_intermediate_size": c.moe_intermediate_size, "intermediate_size": 4 * c.hidden_size,
      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": c.norm_topk_prob,
      "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
      "max_position_embeddings": c.max_position_embeddings,
      "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu",
      "attention_bias": False, "torch_dtype": c.source_dtype,
      "eos_token_id": list(c.eos_token_ids)}
  tmp = hf_dir + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  save_file({n: _to_torch(a) for n, a in tensors.items()}, os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(tmp, "config.json"), "w") as out:
    json.dump(config, out, indent=2)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(ftw_dir, name)):
      shutil.copy2(os.path.join(ftw_dir, name), os.path.join(tmp, name))
  shutil.rmtree(hf_dir, ignore_errors=True)
  os.rename(tmp, hf_dir)
  return hf_dir


def fingerprint(ftw_dir: str, llama_src: str) -> str:
  h = hashlib.sha256(os.path.abspath(llama_src).encode())
  for name in ("ftw.json", "tokenizer.json"):
    with open(os.path.join(ftw_dir, name), "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


# -- llama.cpp ----------------------------------------------------------------------------------

def run_logged(cmd: list[str], log_path: str, **kw) -> str:
  t0 = time.perf_counter()
  with open(log_path, "w") as f:  # a file, not a pipe: through a pipe llama-perplexity's
    proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)  # summary got lost
  with open(log_path) as f:
    out = f.read()
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd[:2])} ... failed (exit {proc.returncode}; {log_path}):\n"
                       f"{out[-3000:]}")
  log(f"{os.path.basename(cmd[0]) if 'python' not in cmd[0] else 'convert'} "
      f"-> {os.path.basename(log_path)} ({time.perf_counter() - t0:.0f} s)")
  return out


def prepare_ggufs(model_name: str, ftw_dir: str, args) -> dict:
  """BF16, Q8_0 (the converter), Q4_K_M and MXFP4_MOE (llama-quantize from BF16) under
  ``work_dir/model_name``; remade when the model or the llama.cpp source changes. Returns
  paths, the round-trip check and what llama-quantize said about fallbacks."""
  d = os.path.join(args.work_dir, model_name)
  os.makedirs(d, exist_ok=True)
  stamp_path = os.path.join(d, "stamp.json")
  stamp = {"model": fingerprint(ftw_dir, args.llama_src), "types": list(LLAMA_TYPES)}
  info_path = os.path.join(d, "ggufs.json")
  if os.path.isfile(stamp_path) and json.load(open(stamp_path)) == stamp:
    return json.load(open(info_path))
  info = {"files": {}, "quantize": {}, "errors": {}}
  hf_dir = os.path.join(d, "hf")
  log(f"{model_name}: exporting a Hugging Face checkpoint to {hf_dir}")
  if MODELS[model_name] == "qwen3_5_moe":
    export_hf(ftw_dir, hf_dir, overwrite=True)
  else:
    export_qwen3_moe(ftw_dir, hf_dir)
  info["round_trip"] = check_round_trip(ftw_dir, hf_dir)
  log(f"{model_name}: round trip through ftjax's converter: {info['round_trip']}")
  script = gguf_converter(args.llama_src, os.path.join(d, "llama-convert"))
  extra = ["--no-mtp"] if MODELS[model_name] == "qwen3_5_moe" else []
  for outtype, name in (("bf16", "BF16"), ("q8_0", "Q8_0")):
    out = os.path.join(d, f"model-{name}.gguf")
    run_logged([sys.executable, script, hf_dir, "--outtype", outtype, "--outfile", out] + extra,
               os.path.join(d, f"convert-{name}.log"))
    info["files"][name] = out
  quantize = os.path.join(args.llama_build, "bin", "llama-quantize")
  for name in ("Q4_K_M", "MXFP4_MOE"):
    out = os.path.join(d, f"model-{name}.gguf")
    try:
      text = run_logged([quantize, info["files"]["BF16"], out, name, str(args.threads)],
                        os.path.join(d, f"quantize-{name}.log"))
    except RuntimeError as e:
      info["errors"][name] = str(e)[-2000:]
      continue
    info["files"][name] = out
    info["quantize"][name] = quantize_summary(text)
  with open(info_path, "w") as f:
    json.dump(info, f, indent=1)
  with open(stamp_path, "w") as f:
    json.dump(stamp, f)
  return info


def quantize_summary(text: str) -> dict:
  """llama-quantize's fallbacks (rows that are not multiples of a k-quant's 256) and the
  type it wrote for each tensor, from its log."""
  fallbacks = [ln.split(":", 1)[-1].strip() for ln in text.splitlines()
               if "falling back" in ln or "not divisible" in ln]
  written: dict[str, list[str]] = {}
  for m in re.finditer(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s.*?type =\s+(\w+)"
                       r"(?:, converting to (\w+))?", text, re.M):
    written.setdefault(m[3] or m[2], []).append(m[1])
  sizes = re.findall(r"(model size|quant size)\s*=\s*([\d.]+ \w+)", text)
  return {"fallbacks": fallbacks, "tensors_by_type": {t: len(v) for t, v in written.items()},
          "expert_tensors_by_type": {t: [n for n in v if "_exps" in n]
                                     for t, v in written.items()
                                     if any("_exps" in n for n in v)},
          "sizes": dict(sizes)}


def read_base_tokens(path: str, n_vocab: int, chunks: int, ctx: int) -> np.ndarray:
  """The tokens llama-perplexity scored, from its base file: ``_logits_``, n_ctx, n_vocab,
  n_chunk, then n_chunk·n_ctx tokens (int32), then the log-probabilities."""
  with open(path, "rb") as f:
    magic = f.read(8)
    n_ctx, n_vocab_file, n_chunk = (int(x) for x in np.frombuffer(f.read(12), np.int32))
    if magic != b"_logits_" or (n_ctx, n_vocab_file, n_chunk) != (ctx, n_vocab, chunks):
      raise RuntimeError(f"{path}: {magic!r}, n_ctx {n_ctx}, n_vocab {n_vocab_file}, n_chunk "
                         f"{n_chunk}; expected _logits_, {ctx}, {n_vocab}, {chunks}")
    return np.frombuffer(f.read(4 * chunks * ctx), np.int32).reshape(chunks, ctx)


def parse_perplexity(text: str) -> dict:
  def num(pattern):
    m = re.search(pattern, text)
    return float(m[1]) if m else None
  out = {"kl": num(r"Mean\s+KLD:\s+([-\d.eE+]+)"),
         "kl_stderr": num(r"Mean\s+KLD:\s+[-\d.eE+]+\s+±\s+([-\d.eE+]+)"),
         "kl_p99": num(r"99\.0%\s+KLD:\s+([-\d.eE+]+)"),
         "same_top_p_pct": num(r"Same top p:\s+([\d.]+)"),
         "ppl": num(r"Mean PPL\(Q\)\s+:\s+([\d.]+)"),
         "ppl_base": num(r"Mean PPL\(base\)\s+:\s+([\d.]+)"),
         "final_estimate_ppl": num(r"Final estimate: PPL = ([\d.]+)")}
  if out["same_top_p_pct"] is not None:
    out["top1_agree"] = out["same_top_p_pct"] / 100
  return out


def perplexity_run(cmd: list[str], log_path: str, key: str, tries: int = 5) -> dict:
  """llama-perplexity, run again when its log lacks the summary line ``key``: its logger is
  a leaked singleton whose worker thread writes the queued lines, so what it has not written
  when ``main`` returns is lost (llama.cpp issue 22142, cited in ``common/log.cpp``); on a
  loaded 2-core VM that is often the last chunk and the summary."""
  for attempt in range(tries):
    row = parse_perplexity(run_logged(cmd, log_path))
    if row[key] is not None:
      return dict(row, attempts=attempt + 1)
    log(f"{log_path}: llama-perplexity's summary was lost at exit; running it again")
  raise RuntimeError(f"{log_path}: llama-perplexity's summary was lost {tries} times")


def llama_side(model_name: str, info: dict, text_path: str, args, n_vocab: int) -> dict:
  d = os.path.join(args.work_dir, model_name)
  perplexity = os.path.join(args.llama_build, "bin", "llama-perplexity")
  base = os.path.join(d, "base.kld")
  common = ["-f", text_path, "-c", str(args.ctx), "-b", str(args.ctx), "--chunks",
            str(args.chunks), "-t", str(args.threads)] + ([] if args.llama_repack else ["-nr"])
  bf16 = info["files"]["BF16"]
  row = perplexity_run([perplexity, "-m", bf16, "--kl-divergence-base", base] + common,
                       os.path.join(d, "perplexity-BF16-base.log"), "final_estimate_ppl")
  rows = {"BF16": {"ppl": row["final_estimate_ppl"], "attempts": row["attempts"]}}
  tokens = read_base_tokens(base, n_vocab, args.chunks, args.ctx)
  for name in ("BF16 (self)",) + LLAMA_TYPES:
    path = bf16 if name == "BF16 (self)" else info["files"].get(name)
    if path is None:
      rows[name] = {"error": info["errors"].get(name, "not made")}
      continue
    rows[name] = perplexity_run([perplexity, "-m", path, "--kl-divergence-base", base,
                                 "--kl-divergence"] + common,
                                os.path.join(d, f"perplexity-{name.split()[0]}"
                                             f"{'-self' if 'self' in name else ''}.log"), "kl")
    rows[name]["file_bytes"] = os.path.getsize(path)
    log(f"{model_name} llama.cpp {name}: KL {rows[name]['kl']}, same top "
        f"{rows[name]['same_top_p_pct']}%, PPL {rows[name]['ppl']}")
  rows["BF16"]["file_bytes"] = os.path.getsize(bf16)
  return {"rows": rows, "tokens": tokens}


def gguf_metadata(path: str) -> dict:
  """The tokenizer fields of a GGUF that decide its token ids."""
  from gguf import GGUFReader  # noqa: PLC0415
  r = GGUFReader(path)
  out = {}
  for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
              "general.architecture"):
    field = r.fields.get(key)
    if field is not None:
      v = field.parts[field.data[0]]
      out[key] = bytes(v).decode() if v.dtype == np.uint8 else v.tolist()
  return out


# -- Report -------------------------------------------------------------------------------------

def table(model_name: str, ftjax_rows: dict, llama: dict | None) -> str:
  lines = [f"\n{model_name} ({MODELS[model_name]}): scored positions ctx/2..ctx-2 of each window",
           f"{'engine':9} {'format':46} {'KL(bf16||q)':>12} {'top-1 agree':>12} {'PPL':>9}"]
  for name, r in ftjax_rows.items():
    lines.append(f"{'ftjax':9} {name:46} {r['kl']:12.5f} {r['top1_agree']:12.4f} {r['ppl']:9.3f}")
  if llama:
    for name, r in llama["rows"].items():
      if "error" in r:
        lines.append(f"{'llama.cpp':9} {name:46} {'error: ' + r['error'][:60]}")
      elif name == "BF16":
        lines.append(f"{'llama.cpp':9} {name:46} {'':>12} {'':>12} {r['ppl']:9.3f}")
      else:
        lines.append(f"{'llama.cpp':9} {name:46} {r['kl']:12.5f} {r['top1_agree']:12.4f} "
                     f"{r['ppl']:9.3f}")
  return "\n".join(lines)


def goal_check(ftjax_rows: dict, llama: dict | None) -> list[dict]:
  out = []
  if not llama:
    return out
  for ours, theirs in GOALS:
    peer = llama["rows"].get(theirs, {})
    if peer.get("kl") is None:
      continue
    a, b = ftjax_rows[ours], peer
    out.append({"ftjax": ours, "llama_cpp": theirs, "ftjax_kl": a["kl"], "llama_kl": b["kl"],
                "kl_ratio": a["kl"] / b["kl"] if b["kl"] else None,
                "ftjax_top1": a["top1_agree"], "llama_top1": b["top1_agree"],
                "no_worse": bool(a["kl"] <= b["kl"])})
  return out


def plot(results: dict, path: str) -> None:
  plt = pyplot()
  if plt is None:
    return
  models = list(results["models"])
  fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
  for ax, name in zip(axes[0], models):
    r = results["models"][name]
    labels, kls, colors = [], [], []
    for v, row in r["ftjax"].items():
      if v != "bf16":
        labels.append(v.split(" (")[0])
        kls.append(row["kl"])
        colors.append("tab:blue")
    for v, row in (r.get("llama_cpp") or {}).get("rows", {}).items():
      if row.get("kl") is not None and v != "BF16 (self)":
        labels.append(f"llama.cpp {v}")
        kls.append(row["kl"])
        colors.append("tab:orange")
    ax.barh(range(len(kls)), kls, color=colors)
    ax.set_yticks(range(len(kls)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("mean KL(bf16 || quantised), nats/token (log)")
    ax.set_title(f"{name} ({MODELS[name]})", fontsize=10)
  fig.suptitle("Quantisation quality on held-out code: ftjax (blue) vs llama.cpp (orange)",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  log(f"wrote {path}")


# -- main ---------------------------------------------------------------------------------------

def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default=",".join(MODELS))
  p.add_argument("--ctx", type=int, default=256, help="tokens per window (the training length)")
  p.add_argument("--chunks", type=int, default=32, help="windows of held-out text")
  p.add_argument("--batch", type=int, default=8, help="windows per ftjax forward")
  p.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
  p.add_argument("--work_dir", default=os.path.join(
      os.environ.get("FTJAX_CACHE_DIR") or os.path.expanduser("~/.cache/ftjax"),
      "dense_quality"))
  p.add_argument("--llama_build", default=LLAMA_BUILD)
  p.add_argument("--llama_src", default=LLAMA_SRC)
  p.add_argument("--no_llama", action="store_true", help="ftjax only")
  p.add_argument("--llama_repack", action="store_true",
                 help="let llama-perplexity repack weights (its default). Off (-nr) by default: "
                 "on the AMX Xeon VM the repacked Q8_0 path dies with SIGILL and Q4_K_M / "
                 "MXFP4_MOE with SIGSEGV")
  p.add_argument("--out", default=None)
  args = p.parse_args()

  from ftjax.assets import EMBEDDED_MODELS  # noqa: PLC0415
  from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
  os.makedirs(args.work_dir, exist_ok=True)
  t_start = time.perf_counter()
  results = {"what": __doc__.split("\n\n")[0], "ctx": args.ctx, "chunks": args.chunks,
             "scored_positions_per_window": args.ctx - 1 - args.ctx // 2,
             "llama_perplexity_flags": "-c CTX -b CTX --chunks N -t THREADS"
                                       + ("" if args.llama_repack else " -nr (no repack)"),
             "machine": machine_info(), "models": {}}
  report = []
  for model_name in args.models.split(","):
    ftw_dir = EMBEDDED_MODELS.get(model_name, model_name)
    with open(os.path.join(ftw_dir, "ftw.json")) as f:
      vocab = json.load(f)["model_config"]["vocab_size"]
    tok = load_tokenizer(ftw_dir, vocab)
    text = heldout_text(tok, args.chunks * args.ctx)
    text_path = os.path.join(args.work_dir, f"heldout-{model_name}.txt")
    with open(text_path, "w") as f:
      f.write(text)
    ids = np.asarray(tok.encode(text), np.int32)
    win = windows(ids, args.chunks, args.ctx)
    log(f"{model_name}: {len(text)} characters of held-out code, {len(ids)} tokens, "
        f"{args.chunks} windows of {args.ctx} ({text_path})")
    entry = {"text": {"path": text_path, "characters": len(text), "tokens": int(len(ids)),
                      "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}}
    entry["ftjax"] = ftjax_side(model_name, win, args.batch)
    llama = None
    if not args.no_llama:
      try:
        info = prepare_ggufs(model_name, ftw_dir, args)
        llama = llama_side(model_name, info, text_path, args, vocab)
        same = llama.pop("tokens") == win
        entry["llama_cpp"] = dict(llama, files={k: os.path.basename(v) for k, v in
                                                info["files"].items()},
                                  quantize=info["quantize"], errors=info["errors"],
                                  round_trip=info["round_trip"],
                                  gguf_tokenizer=gguf_metadata(info["files"]["BF16"]))
        entry["same_tokens"] = {"windows_identical": int(same.all(axis=1).sum()),
                                "windows": args.chunks,
                                "tokens_identical": float(same.mean())}
        log(f"{model_name}: llama.cpp scored the same tokens as ftjax in "
            f"{entry['same_tokens']['windows_identical']} of {args.chunks} windows")
      except Exception as e:  # noqa: BLE001 (recorded: the other model and side still run)
        log(f"{model_name}: llama.cpp side failed: {type(e).__name__}: {e}")
        entry["llama_cpp_error"] = f"{type(e).__name__}: {str(e)[-3000:]}"
    entry["goal_check"] = goal_check(entry["ftjax"], llama)
    results["models"][model_name] = entry
    report.append(table(model_name, entry["ftjax"], llama))
    for g in entry["goal_check"]:
      report.append(f"  goal: ftjax {g['ftjax']} KL {g['ftjax_kl']:.5f} vs llama.cpp "
                    f"{g['llama_cpp']} {g['llama_kl']:.5f} (x{g['kl_ratio']:.2f}): "
                    f"{'no worse' if g['no_worse'] else 'WORSE'}")
  results["seconds"] = round(time.perf_counter() - t_start, 1)
  out = write_results("dense_quality", results, args.out)
  plot(results, os.path.splitext(out)[0] + ".png")
  print("\n".join(report))
  print(f"\nwrote {out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
  main()
