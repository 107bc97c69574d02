"""Hybrid Gated-DeltaNet MoE decode and prefill: ftjax and llama.cpp side by side.

The model is a ``--layers``-layer model (default 4) with Qwen3.5-35B-A3B's layer shapes:
three Gated-DeltaNet (linear-attention) layers and one full-attention layer, hidden 2048,
16 query / 2 KV heads of 256 (gated output, partial rotary 0.25, rope_theta 1e7), linear
attention with 16 key / 32 value heads of 128 and a 4-tap conv, 256 experts, top-8, expert
width 512, a shared expert of width 512, vocab 248320, untied lm_head, random bfloat16
weights. Everything below is written once into ``--cache_dir`` (default under /tmp; reused
while present; never committed):

1. ``hf/``: a Hugging Face ``Qwen3_5MoeForCausalLM`` checkpoint (model_type
   ``qwen3_5_moe_text``; config.json from transformers' ``Qwen3_5MoeTextConfig``), written
   tensor by tensor into one safetensors shard per layer (8.6 GB at 4 layers; the torch
   model is never instantiated). Tensor names are the ones transformers saves (per-expert
   ``mlp.experts.E.{gate,up,down}_proj``). Values: weights ~N(0, 0.02); the (1 + w) RMSNorm
   weights ~N(0, 0.1) around their zero init; the gated linear-attention norm ~1 + N(0, 0.1);
   conv taps ~U(-0.5, 0.5) (torch's Conv1d init); A_log = log U(1, 16); dt_bias ~1 + N(0, 0.1).
   The tokenizer is a stand-in: the default model's byte-level BPE ``tokenizer.json`` (4096
   tokens) with ``tokenizer_config.json`` = ``{"tokenizer_class": "PreTrainedTokenizerFast"}``;
   llama.cpp's converter pads the vocabulary to 248320 with unused ``[PADi]`` tokens.
2. ``ftw/``: ``ftjax.convert_hf(hf, ftw, dtype="bfloat16")``, run by the ftjax worker.
3. ``model-bf16.gguf``: llama.cpp's own converter,
   ``python convert_hf_to_gguf.py hf --outtype bf16 --no-mtp --outfile model-bf16.gguf``, run
   from a copy in ``llama-convert/`` (``convert_hf_to_gguf.py`` and its ``conversion/``
   package) in which ``get_vocab_base_pre`` returns ``"default"`` for the stand-in's unknown
   pre-tokenizer instead of raising (``../shared/PEERS.md``). It needs llama.cpp's ``gguf-py``:
   ``pip install $SRC/gguf-py``.

llama.cpp is the CPU build from the source tree vendored in the llama-cpp-python sdist (never
committed; about 12 minutes on 2 cores):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama
    SRC=/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S $SRC -B /tmp/llama/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
          -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
          -DLLAMA_BUILD_SERVER=OFF
    cmake --build /tmp/llama/build -j2 --target llama-bench
    /work/venv/bin/pip install $SRC/gguf-py

Measurement, in ``--rounds`` alternating rounds (ftjax, then llama.cpp):

- ftjax (a worker process that loads the FTW model pre-faulted, ``kernels=--kernels``, and
  compiles in one discarded round first): the host read bandwidth (``ftjax.kernels.read_probe``
  over one layer's experts, 1.6 GB, best of 3), a greedy decode of ``--decode_tokens`` + 1
  new tokens after an 8-token prompt (``--decode_tokens`` decode steps) and a
  ``--prefill_tokens``-token prefill (one new token);
- llama.cpp: ``llama-bench -m model-bf16.gguf -p 512 -n 64 -t 2 -r 1 -lm none -o json`` (the
  ``pp512`` and ``tg64`` tests of one invocation; ``-lm none`` reads the weights into RAM
  instead of mapping them, ``../shared/PEERS.md``).

A decoded token reads every dense weight but the embedding table (one row of it) plus
``top_k`` experts per layer; those bytes / the read bandwidth of the same round is the
roofline step time. Goals (the issue): ftjax decode >= 1.15x llama.cpp's and >= 0.85 of the
roofline; 512-token prefill >= 1.0x llama.cpp's. Medians over the rounds, and each round's
ratio. Each measurement records ``other_load``, the cores other processes kept busy meanwhile
(/proc/stat minus this benchmark's CPU time); above 0.1 it is flagged as contended.

  /work/venv/bin/python benchmarks/hybrid_e2e.py --current_src   # this checkout's src/
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
from common import write_results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(REPO, "src", "ftjax", "assets", "default_model", "tokenizer.json")
LLAMA_SRC = "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
LLAMA_BUILD = "/tmp/llama/build"
GOAL_DECODE_VS_LLAMA = 1.15  # ftjax decode tok/s / llama.cpp's
GOAL_ROOFLINE = 0.85  # ftjax decode tok/s / roofline tok/s
GOAL_PREFILL_VS_LLAMA = 1.0  # ftjax 512-token prefill tok/s / llama.cpp's
GENERATOR_VERSION = 1  # bump when write_hf_checkpoint changes what it writes

# Qwen3.5-35B-A3B's text shapes (transformers' Qwen3_5MoeTextConfig defaults, with the
# released model's rope_theta and context); only the number of layers differs.
QWEN3_5_35B_A3B = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
    max_position_embeddings=262144, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


# -- The random checkpoint (driver side; torch, safetensors, transformers' config class). -----

def hf_config(layers: int, **overrides) -> dict:
  """config.json of a ``layers``-layer Qwen3.5-35B-A3B-shaped ``Qwen3_5MoeForCausalLM``: every
  fourth layer full attention, the rest Gated DeltaNet, as in the released model."""
  from transformers import Qwen3_5MoeTextConfig  # noqa: PLC0415
  kwargs = dict(QWEN3_5_35B_A3B, **overrides)
  types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
  config = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=types, **kwargs)
  out = config.to_dict()
  out.update(architectures=["Qwen3_5MoeForCausalLM"], dtype="bfloat16",
             model_type="qwen3_5_moe_text")
  return out


def layer_shapes(c: dict, layer: int) -> dict[str, tuple[int, ...]]:
  """Name -> shape of one decoder layer's tensors, as transformers saves them."""
  d, p = c["hidden_size"], f"model.layers.{layer}."
  out = {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
  if c["layer_types"][layer] == "linear_attention":
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv
    a = p + "linear_attn."
    out.update({
        a + "in_proj_qkv.weight": (conv, d), a + "in_proj_z.weight": (hv * dv, d),
        a + "in_proj_b.weight": (hv, d), a + "in_proj_a.weight": (hv, d),
        a + "conv1d.weight": (conv, 1, c["linear_conv_kernel_dim"]),
        a + "dt_bias": (hv,), a + "A_log": (hv,), a + "norm.weight": (dv,),
        a + "out_proj.weight": (d, hv * dv)})
  else:
    h, g, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    a = p + "self_attn."
    out.update({
        a + "q_proj.weight": (2 * h * hd, d),  # query and output gate, interleaved per head
        a + "k_proj.weight": (g * hd, d), a + "v_proj.weight": (g * hd, d),
        a + "o_proj.weight": (d, h * hd), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
  f, fs, m = c["moe_intermediate_size"], c["shared_expert_intermediate_size"], p + "mlp."
  out[m + "gate.weight"] = (c["num_experts"], d)
  for e in range(c["num_experts"]):
    x = f"{m}experts.{e}."
    out.update({x + "gate_proj.weight": (f, d), x + "up_proj.weight": (f, d),
                x + "down_proj.weight": (d, f)})
  out.update({m + "shared_expert.gate_proj.weight": (fs, d),
              m + "shared_expert.up_proj.weight": (fs, d),
              m + "shared_expert.down_proj.weight": (d, fs),
              m + "shared_expert_gate.weight": (1, d)})
  return out


def random_tensor(name: str, shape: tuple[int, ...], gen):
  """A bfloat16 tensor with values in the range the released model's tensors have at init."""
  import torch  # noqa: PLC0415
  t = torch.empty(shape, dtype=torch.float32)
  if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight, init 1
    t.normal_(1.0, 0.1, generator=gen)
  elif name.endswith("norm.weight"):  # the (1 + w) RMSNorms: init 0
    t.normal_(0.0, 0.1, generator=gen)
  elif name.endswith("A_log"):
    t.uniform_(1.0, 16.0, generator=gen).log_()
  elif name.endswith("dt_bias"):
    t.normal_(1.0, 0.1, generator=gen)
  elif name.endswith("conv1d.weight"):
    t.uniform_(-0.5, 0.5, generator=gen)
  else:
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
  return t.to(torch.bfloat16)


def write_hf_checkpoint(out_dir: str, layers: int, seed: int = 0, **overrides) -> str:
  """Writes the random checkpoint into ``out_dir`` (through ``out_dir.partial``): one shard
  per layer plus one for the embedding, final norm and lm_head, and the shard index."""
  import torch  # noqa: PLC0415
  from safetensors.torch import save_file  # noqa: PLC0415
  c = hf_config(layers, **overrides)
  tmp = out_dir + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  gen = torch.Generator().manual_seed(seed)
  v, d = c["vocab_size"], c["hidden_size"]
  groups = [{"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
             "lm_head.weight": (v, d)}] + [layer_shapes(c, i) for i in range(layers)]
  names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
  weight_map, total = {}, 0
  t0 = time.perf_counter()
  for shard, shapes in zip(names, groups):
    tensors = {n: random_tensor(n, s, gen) for n, s in shapes.items()}
    save_file(tensors, os.path.join(tmp, shard), metadata={"format": "pt"})
    total += sum(t.nbytes for t in tensors.values())
    weight_map.update(dict.fromkeys(tensors, shard))
    del tensors
    print(f"  wrote {shard} ({time.perf_counter() - t0:.0f} s)", flush=True)
  with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(c, f, indent=2)
  shutil.copy(DEFAULT_TOKENIZER, os.path.join(tmp, "tokenizer.json"))
  with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
  with open(os.path.join(tmp, "generator.json"), "w") as f:
    json.dump(generator_stamp(layers, seed, overrides), f)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.rename(tmp, out_dir)
  return out_dir


def generator_stamp(layers: int, seed: int, overrides: dict) -> dict:
  return {"generator": "benchmarks/hybrid_e2e.py", "version": GENERATOR_VERSION,
          "layers": layers, "seed": seed, "overrides": overrides}


def hf_is_current(hf_dir: str, layers: int, seed: int = 0) -> bool:
  try:
    with open(os.path.join(hf_dir, "generator.json")) as f:
      return json.load(f) == generator_stamp(layers, seed, {})
  except (OSError, ValueError):
    return False


# -- llama.cpp side (driver). --------------------------------------------------------------------

def patched_converter(llama_src: str, dest: str) -> str:
  """A copy of llama.cpp's ``convert_hf_to_gguf.py`` and ``conversion/`` in ``dest`` whose
  ``get_vocab_base_pre`` returns ``"default"`` for an unknown BPE pre-tokenizer."""
  script = os.path.join(dest, "convert_hf_to_gguf.py")
  if os.path.isfile(script):
    return script
  tmp = dest + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  shutil.copy(os.path.join(llama_src, "convert_hf_to_gguf.py"), tmp)
  shutil.copytree(os.path.join(llama_src, "conversion"), os.path.join(tmp, "conversion"))
  base = os.path.join(tmp, "conversion", "base.py")
  with open(base) as f:
    text = f.read()
  old = ('raise NotImplementedError("BPE pre-tokenizer was not recognized - update '
         'get_vocab_base_pre()")')
  if text.count(old) != 1:
    raise RuntimeError(f"{base}: expected one '{old}' to patch, found {text.count(old)}")
  with open(base, "w") as f:
    f.write(text.replace(old, 'res = "default"  # patched by benchmarks/hybrid_e2e.py'))
  os.rename(tmp, dest)
  return script


def convert_gguf(llama_src: str, hf_dir: str, out_path: str, cache_dir: str) -> None:
  script = patched_converter(llama_src, os.path.join(cache_dir, "llama-convert"))
  tmp = out_path + ".partial"
  log_path = os.path.join(cache_dir, "convert_gguf.log")
  print(f"converting to GGUF with llama.cpp's converter (log {log_path})", flush=True)
  t0 = time.perf_counter()
  with open(log_path, "w") as f:
    proc = subprocess.run([sys.executable, script, hf_dir, "--outtype", "bf16", "--no-mtp",
                           "--outfile", tmp], stdout=f, stderr=subprocess.STDOUT)
  if proc.returncode:
    with open(log_path) as f:
      raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n"
                         f"{f.read()[-3000:]}")
  os.rename(tmp, out_path)
  print(f"  {out_path} in {time.perf_counter() - t0:.0f} s", flush=True)


def llama_bench(build: str, gguf: str, threads: int, prefill: int, decode: int) -> dict:
  """One llama-bench invocation: the ``pp<prefill>`` and ``tg<decode>`` tests, weights in RAM."""
  cmd = [os.path.join(build, "bin", "llama-bench"), "-m", gguf, "-p", str(prefill),
         "-n", str(decode), "-t", str(threads), "-r", "1", "-lm", "none", "-o", "json"]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  tests = json.loads(proc.stdout)
  pp = next(t for t in tests if t["n_prompt"] == prefill and t["n_gen"] == 0)
  tg = next(t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == decode)
  return {"decode_tok_s": tg["avg_ts"], "prefill_tok_s": pp["avg_ts"],
          "wall_s": time.perf_counter() - t0, "tests": tests}


# -- ftjax side: a worker process, with whichever ftjax its sys.path gives. -------------------

def log(msg: str) -> None:
  print(f"[ftjax] {msg}", file=sys.stderr, flush=True)


def bytes_per_token(model) -> int:
  """Weights one decode step reads: every dense tensor but the embedding table (one row of
  it), plus top-k experts per MoE layer."""
  c = model.config
  tensors = model.storage.index["tensors"]
  dense = sum(t["nbytes"] for n, t in tensors.items() if not n.startswith("embed"))
  row = c.hidden_size * model.dtype.itemsize
  expert = c.expert_block_elems * model.dtype.itemsize
  return dense + row + c.num_moe_layers * c.top_k * expert


def read_bandwidth(buf, repeats: int = 3) -> float:
  """Bytes per second of the fastest of ``repeats`` read probes over ``buf`` (after one)."""
  from ftjax.kernels import read_probe  # noqa: PLC0415
  read_probe(buf).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    read_probe(buf).block_until_ready()
    times.append(time.perf_counter() - t0)
  return buf.nbytes / min(times)


def major_faults() -> int:
  import resource  # noqa: PLC0415
  return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class Worker:
  """The model and its engine, converted if needed, loaded and compiled once; ``measure``
  is one round."""

  def __init__(self, args):
    import numpy as np  # noqa: PLC0415

    import ftjax  # noqa: PLC0415
    self.args = args
    hf_dir, ftw_dir = os.path.join(args.cache_dir, "hf"), os.path.join(args.cache_dir, "ftw")
    if args.reconvert or not os.path.isdir(ftw_dir):
      t0 = time.perf_counter()
      ftjax.convert_hf(hf_dir, ftw_dir, dtype="bfloat16", overwrite=True)
      log(f"converted {hf_dir} -> {ftw_dir} in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    self.model = ftjax.load(ftw_dir, verify=False, populate=True)
    log(f"loaded and pre-faulted {ftw_dir} in {time.perf_counter() - t0:.1f} s")
    self.per_token = bytes_per_token(self.model)
    self.probe = self.model.bank[0]  # one layer's experts (1.6 GB), far larger than the L3
    self.engine = ftjax.Engine(self.model, kernels=args.kernels, max_seq_len=4096)
    prompt = np.random.default_rng(0).integers(0, self.model.config.vocab_size,
                                               args.prefill_tokens).tolist()
    self.prompt, self.short = prompt, prompt[:8]
    t0 = time.perf_counter()
    self.logits = self.engine.forward_logits(self.short)
    self.measure()  # compiles every shape the rounds use; discarded
    log(f"warm-up round (compiles) {time.perf_counter() - t0:.1f} s")

  def info(self) -> dict:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import ftjax  # noqa: PLC0415
    from common import machine_info  # noqa: PLC0415
    c = self.model.config
    return {"ftjax": os.path.dirname(ftjax.__file__), "jax": jax.__version__,
            "model_type": c.model_type, "layer_types": list(c.layer_types),
            "bytes_per_token": self.per_token, "probe_bytes": self.probe.nbytes,
            "kernels": self.engine.kernels, "kernels_path": self.engine.kernels_path,
            "prompt_logits_finite": bool(np.isfinite(self.logits).all()),
            "prompt_logits_std": float(np.std(self.logits)), "machine": machine_info()}

  def measure(self) -> dict:
    a = self.args
    # llama.cpp reads its weights again before each of its runs. ftjax's weights are a mapped
    # file, which the page cache may have evicted in the meantime (llama.cpp's 8.6 GB load
    # pushes them out on a 24 GiB machine): fault them back in before timing, like llama.cpp's
    # load. major_faults then counts only faults inside the timed work.
    self.model.storage.populate()
    faults = major_faults()
    bw = read_bandwidth(self.probe)
    dec = self.engine.generate_timed(self.short, a.decode_tokens + 1, greedy=True)
    pre = self.engine.generate_timed(self.prompt, 1, greedy=True)
    step_s = dec.decode_s / (len(dec.tokens) - 1)
    ideal_s = self.per_token / bw
    return {
        "read_gb_s": bw / 1e9,
        "decode_new_tokens": len(dec.tokens),
        "decode_distinct_tokens": len(set(dec.tokens)),
        "decode_programs": dec.programs,
        "step_ms": step_s * 1e3,
        "roofline_step_ms": ideal_s * 1e3,
        "decode_tok_s": 1 / step_s,
        "roofline_tok_s": 1 / ideal_s,
        "decode_vs_roofline": ideal_s / step_s,
        "prefill_tok_s": pre.prefill_tok_s,
        "major_faults": major_faults() - faults,  # > 0: weights were paged back in
    }


def worker_main(args) -> None:
  """Answers one JSON line on the original stdout per request line on stdin."""
  reply = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # anything else printed (progress, kernel notices) goes to stderr
  worker = Worker(args)
  ops = {"info": worker.info, "measure": worker.measure}
  reply.write(json.dumps({"ready": True}) + "\n")
  reply.flush()
  for line in sys.stdin:
    op = line.strip()
    if op == "quit":
      break
    reply.write(json.dumps(ops[op]()) + "\n")
    reply.flush()


class FtjaxSide:
  """The worker process: ``ask(op)`` sends a request and returns its JSON answer."""

  def __init__(self, args):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if args.current_src:
      env["PYTHONPATH"] = os.path.join(REPO, "src")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           f"--cache_dir={args.cache_dir}", f"--kernels={args.kernels}",
           f"--decode_tokens={args.decode_tokens}", f"--prefill_tokens={args.prefill_tokens}"]
    if args.reconvert:
      cmd.append("--reconvert")
    # cwd outside the checkout: without --current_src the installed ftjax is imported.
    self.proc = subprocess.Popen(cmd, env=env, cwd=args.cache_dir, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    self._read()  # {"ready": true} once loaded and compiled

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the ftjax worker exited (code {self.proc.wait()}); its messages "
                         "are above")
    return json.loads(line)

  def ask(self, op: str) -> dict:
    self.proc.stdin.write(op + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()


# -- Driver. ---------------------------------------------------------------------------------

def prepare(args) -> tuple[str, str]:
  """(hf dir, gguf path), written into the cache dir unless present and current."""
  os.makedirs(args.cache_dir, exist_ok=True)
  hf_dir = os.path.join(args.cache_dir, "hf")
  gguf = os.path.join(args.cache_dir, "model-bf16.gguf")
  if not hf_is_current(hf_dir, args.layers):
    print(f"writing the random {args.layers}-layer checkpoint into {hf_dir} (~8.6 GB at 4 "
          "layers)", flush=True)
    shutil.rmtree(os.path.join(args.cache_dir, "ftw"), ignore_errors=True)  # made from the
    if os.path.exists(gguf):  # old checkpoint
      os.remove(gguf)
    write_hf_checkpoint(hf_dir, args.layers)
  if not os.path.isfile(gguf):
    convert_gguf(args.llama_src, hf_dir, gguf, args.cache_dir)
  return hf_dir, gguf


def cpu_seconds(worker_pid: int) -> tuple[float, float]:
  """(CPU seconds the whole machine has been busy, incl. steal; CPU seconds of this benchmark:
  the driver, its reaped children (llama-bench) and the ftjax worker), from /proc."""
  import resource  # noqa: PLC0415
  tick = os.sysconf("SC_CLK_TCK")
  with open("/proc/stat") as f:
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
  with open(f"/proc/{worker_pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  ours = sum(getattr(resource.getrusage(who), k) for who in (resource.RUSAGE_SELF,
             resource.RUSAGE_CHILDREN) for k in ("ru_utime", "ru_stime"))
  ours += (int(fields[11]) + int(fields[12])) / tick  # the worker's utime + stime
  return (user + nice + system + irq + softirq + steal) / tick, ours


def with_other_load(fn, worker_pid: int) -> dict:
  """``fn()``'s dict plus ``other_load``: the cores that anything but this benchmark kept
  busy, on average, while ``fn`` ran (0 on an idle machine; each side uses every core)."""
  busy0, ours0 = cpu_seconds(worker_pid)
  t0 = time.perf_counter()
  out = fn()
  wall = time.perf_counter() - t0
  busy1, ours1 = cpu_seconds(worker_pid)
  out["other_load"] = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall
  return out


def contended(row: dict, limit: float = 0.1) -> str:
  return (f"; CONTENDED: other work kept {row['other_load']:.2f} cores busy"
          if row["other_load"] > limit else "")


def median(rows: list[dict], key: str):
  values = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(values) if values else None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--current_src", action="store_true",
                      help="ftjax from this checkout's src/ instead of the installed package")
  parser.add_argument("--cache_dir", default="/tmp/ftjax-bench/qwen3.5-35b-a3b-shape",
                      help="the HF checkpoint, FTW model, GGUF and converter copy; reused")
  parser.add_argument("--llama_src", default=LLAMA_SRC,
                      help="llama.cpp's source tree (for convert_hf_to_gguf.py)")
  parser.add_argument("--llama_build", default=LLAMA_BUILD,
                      help="llama.cpp's CPU build directory (bin/llama-bench)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
  parser.add_argument("--kernels", default="auto", choices=["auto", "ffi", "ffi_bf16"],
                      help="ftjax kernels (auto: ffi_bf16 for this bf16 model on a CPU)")
  parser.add_argument("--decode_tokens", type=int, default=64, help="decode steps per round")
  parser.add_argument("--prefill_tokens", type=int, default=512)
  parser.add_argument("--reconvert", action="store_true",
                      help="convert the FTW model again (after a converter change)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker_main(args)
    return

  t_start = time.perf_counter()
  hf_dir, gguf = prepare(args)
  print("starting the ftjax worker (converts if needed, loads, compiles)", flush=True)
  t0 = time.perf_counter()
  ftjax_side = FtjaxSide(args)
  rounds: dict[str, list[dict]] = {"ftjax": [], "llama.cpp": []}
  try:
    print(f"  ready in {time.perf_counter() - t0:.0f} s", flush=True)
    info = ftjax_side.ask("info")
    machine = info.pop("machine")
    if not info["prompt_logits_finite"]:
      print("WARNING: the ftjax logits of the prompt are not finite", flush=True)
    for r in range(args.rounds):
      row = with_other_load(lambda: ftjax_side.ask("measure"), ftjax_side.proc.pid)
      rounds["ftjax"].append(row)
      print(f"round {r}     ftjax: read {row['read_gb_s']:5.1f} GB/s, decode "
            f"{row['decode_tok_s']:6.2f} tok/s ({row['decode_vs_roofline']:.2f} of the roofline "
            f"{row['roofline_tok_s']:.2f}), prefill {row['prefill_tok_s']:6.1f} tok/s"
            + (f", {row['major_faults']} major faults" if row["major_faults"] else "")
            + contended(row), flush=True)
      peer = with_other_load(lambda: llama_bench(
          args.llama_build, gguf, args.threads, args.prefill_tokens, args.decode_tokens),
          ftjax_side.proc.pid)
      peer["decode_vs_roofline"] = peer["decode_tok_s"] / row["roofline_tok_s"]
      rounds["llama.cpp"].append(peer)
      print(f"round {r} llama.cpp: decode {peer['decode_tok_s']:6.2f} tok/s "
            f"({peer['decode_vs_roofline']:.2f} of the same roofline), prefill "
            f"{peer['prefill_tok_s']:6.1f} tok/s ({peer['wall_s']:.0f} s with its load)"
            + contended(peer), flush=True)
  finally:
    ftjax_side.close()

  keys = ("decode_tok_s", "prefill_tok_s", "decode_vs_roofline", "other_load")
  med = {side: {k: median(rows, k) for k in keys} for side, rows in rounds.items()}
  for k in ("read_gb_s", "step_ms", "roofline_step_ms", "roofline_tok_s"):
    med["ftjax"][k] = median(rounds["ftjax"], k)
  ours, peer = med["ftjax"], med["llama.cpp"]
  decode_ratio = ours["decode_tok_s"] / peer["decode_tok_s"]
  prefill_ratio = ours["prefill_tok_s"] / peer["prefill_tok_s"]
  # Each round's ftjax / llama.cpp ratio: the two ran back to back, so a change of machine
  # state between rounds (other work, the VM's bandwidth) shows as spread here.
  per_round = {k: [a[k] / b[k] for a, b in zip(rounds["ftjax"], rounds["llama.cpp"])]
               for k in ("decode_tok_s", "prefill_tok_s")}
  goals = {
      "decode_vs_llama": {"goal": f">= {GOAL_DECODE_VS_LLAMA}", "value": decode_ratio,
                          "met": decode_ratio >= GOAL_DECODE_VS_LLAMA},
      "decode_vs_roofline": {"goal": f">= {GOAL_ROOFLINE}", "value": ours["decode_vs_roofline"],
                             "met": ours["decode_vs_roofline"] >= GOAL_ROOFLINE},
      "prefill_vs_llama": {"goal": f">= {GOAL_PREFILL_VS_LLAMA}", "value": prefill_ratio,
                           "met": prefill_ratio >= GOAL_PREFILL_VS_LLAMA},
  }

  def met(name):
    g = goals[name]
    return f"goal {g['goal']}: {'met' if g['met'] else 'NOT met'}"

  tests = rounds["llama.cpp"][0]["tests"]
  print(f"\nmedians over {args.rounds} rounds; ftjax {info['ftjax']} ({info['kernels_path']}), "
        f"llama.cpp {tests[0].get('build_commit')} ({args.threads} threads)")
  print(f"  {args.layers}-layer Qwen3.5-35B-A3B shape, {info['bytes_per_token'] / 1e9:.3f} GB "
        f"read per decoded token; read bandwidth {ours['read_gb_s']:.1f} GB/s, roofline "
        f"{ours['roofline_tok_s']:.2f} tok/s")
  print(f"  {'':<28} {'ftjax':>10} {'llama.cpp':>10} {'ratio':>7}")
  print(f"  {'decode tok/s':<28} {ours['decode_tok_s']:10.2f} {peer['decode_tok_s']:10.2f} "
        f"{decode_ratio:6.2f}x  {met('decode_vs_llama')}")
  print(f"  {'decode / roofline':<28} {ours['decode_vs_roofline']:10.3f} "
        f"{peer['decode_vs_roofline']:10.3f} {'':>7}  {met('decode_vs_roofline')}")
  print(f"  {f'prefill {args.prefill_tokens} tokens tok/s':<28} {ours['prefill_tok_s']:10.1f} "
        f"{peer['prefill_tok_s']:10.1f} {prefill_ratio:6.2f}x  {met('prefill_vs_llama')}")
  print("  ftjax / llama.cpp per round: decode "
        + ", ".join(f"{x:.2f}" for x in per_round["decode_tok_s"]) + "; prefill "
        + ", ".join(f"{x:.2f}" for x in per_round["prefill_tok_s"]))
  busy = [r for side in rounds.values() for r in side if r["other_load"] > 0.1]
  if busy:
    print(f"  WARNING: {len(busy)} of {2 * args.rounds} measurements ran while other work kept "
          "the CPUs busy (other_load > 0.1 cores); rerun on an idle machine")
  runtime = time.perf_counter() - t_start
  llama_info = {k: tests[0].get(k) for k in ("build_commit", "build_number", "cpu_info",
                                              "backends", "model_type", "model_size",
                                              "model_n_params", "n_threads", "n_batch",
                                              "n_ubatch", "type_k", "type_v", "use_mmap")}
  out = write_results("hybrid_e2e", {
      "machine": machine, "ftjax": info, "llama.cpp": llama_info,
      "config": {"layers": args.layers, "kernels": args.kernels,
                 "hf_config": hf_config(args.layers), "decode_tokens": args.decode_tokens,
                 "prefill_tokens": args.prefill_tokens, "threads": args.threads},
      "goals": goals, "median": med, "ratio_per_round": per_round, "rounds": rounds,
      "runtime_s": runtime, "args": vars(args)})
  print(f"wrote {out} ({runtime:.0f} s in all)")


if __name__ == "__main__":
  main()
