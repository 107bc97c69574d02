"""Kernels tuned to the machine they run on: the host kernels' variants measured on this CPU, and
the fastest kept in a tuning file that every later run reads.

What varies (``Tuning``; the C++ side is ``KernelTuning`` in xla_ffi/cpu_kernels.h): the one-token
kernels' software prefetch (distance and hint) and accumulators per row, the rows per task of the
one-token GEMV, and the rows per register block of the 2-64-token dot kernels. Every variant
computes each output in the same order as the defaults, except the one-token accumulators (4 or 8
partial sums along the row), which change float32 rounding only; tests run each variant against
float64.

``measure`` times them on the model's shapes, in three stages of alternating rounds (medians):

  1. one token: prefetch distance x hint x accumulators, on the lm_head-like GEMV (``dense``,
     [rows, hidden] bf16) and the decode expert FFN (``expert_ffn``, top-k experts rotating over a
     bank larger than the last-level cache), each variant scored by its time relative to the
     built-in default's, averaged over the two (a variant must beat the stage's baseline by
     ``MARGIN`` to replace it: the noise of the 2-core VMs);
  2. the GEMV's rows per task, with stage 1's choice;
  3. rows per register block at 4 and 8 tokens (a batch's decode step), with both choices.

Each stage's baseline is the earlier stages' choice with this stage's fields at their defaults, and
a variant equal to it (the default rows of the ISA) is not measured twice.

``resolve(mode, ...)`` is what ``Engine(kernel_tuning=...)`` (``--kernel_tuning``) calls: ``off``
keeps the built-in defaults; ``auto`` reads this machine's tuning file, or measures and writes it
when there is none (10-20 seconds, once per machine, CPU, ISA, thread count, ftjax build and model
shape: the hidden width, the experts' width, top-k and whether the activations are bf16); a path
reads that file, which must have been measured on this machine (for any shape). ``python -m
ftjax.profile`` measures again and overwrites. The files live under
``$FTJAX_CACHE_DIR/kernel_tuning/``.

The measured weights (``workload_bytes``) are twice the CPU's largest cache, so that every variant
reads from memory as a model's decode does: at a fixed 128 MiB, a 480 MiB L3 (an Intel Xeon of
this project's machines) held most of them, and the GEMV measured 1.4x the memory's read
bandwidth.

The tuning is the process's (the kernels are): an engine that resolves one sets it for every later
kernel call. ftjax._ffi_cuda (the GPU path's host experts) keeps its built-in defaults.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import ffi_module, require
from ftjax.kernels.cpu_info import (build_digest, cpu_info, cpu_model, ftjax_version,
                                     last_level_cache_bytes)
from ftjax.kernels.dense import dense
from ftjax.kernels.expert_ffn import expert_ffn
from ftjax.kernels.read_probe import read_probe
from ftjax.utils import paths
from ftjax.utils.progress import Progress

MODES_HELP = ("off (built-in defaults), auto (this machine's tuning file, measured on the first "
              "run when there is none), or the path of a tuning file")
HINTS = ("auto", "nta", "l2")  # as numbered by KernelTuning::prefetch_hint
FILE_VERSION = 1
SIMD_ISAS = ("avx2", "avx512", "avx512bf16")  # the scalar kernels have nothing to tune


@dataclasses.dataclass(frozen=True)
class Tuning:
  """One variant of the host kernels (KernelTuning in xla_ffi/cpu_kernels.h); each field's
  default keeps the built-in choice.

  prefetch_bytes: one token, how far ahead the software prefetch reads (0: none; -1: 6144).
  prefetch_hint: its hint: "nta", "l2" or "auto" (non-temporal on AMD, into L2 elsewhere).
  row_accumulators: one token, partial sums per row: 4 or 8 (0: by the ISA's vector width).
  block_rows: 2-64 tokens, weight rows per register block: 1 to 4 (0: by the ISA's
    registers, 4 with AVX-512, 2 with AVX2).
  gemv_task_kib: one token, KiB of weights per task of the GEMV (0: 2048).
  packed_min_tokens: the packed-activation GEMMs run above this many tokens (-1: the ISA's).
  """

  prefetch_bytes: int = -1
  prefetch_hint: str = "auto"
  row_accumulators: int = 0
  block_rows: int = 0
  gemv_task_kib: int = 0
  packed_min_tokens: int = -1

  def __post_init__(self):
    if self.prefetch_hint not in HINTS:
      raise ValueError(f"prefetch_hint must be one of {', '.join(HINTS)}, got "
                       f"{self.prefetch_hint!r}")

  @property
  def name(self) -> str:
    """Its non-default fields, e.g. "prefetch=3072,l2,acc=8,rows=1"; "default" for none."""
    parts = []
    if self.prefetch_bytes >= 0:
      parts.append(f"prefetch={self.prefetch_bytes}")
    if self.prefetch_hint != "auto":
      parts.append(self.prefetch_hint)
    if self.row_accumulators:
      parts.append(f"acc={self.row_accumulators}")
    if self.block_rows:
      parts.append(f"rows={self.block_rows}")
    if self.gemv_task_kib:
      parts.append(f"gemv_task={self.gemv_task_kib}KiB")
    if self.packed_min_tokens >= 0:
      parts.append(f"packed>{self.packed_min_tokens}")
    return ",".join(parts) or "default"

  @classmethod
  def from_dict(cls, fields: dict) -> Tuning:
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown kernel tuning fields {sorted(unknown)}")
    return cls(**fields)


DEFAULT = Tuning()


def apply(tuning: Tuning) -> None:
  """Sets ``tuning`` for every later host-kernel call of this process. A value the kernels do
  not accept raises ValueError naming the rule, and nothing changes."""
  require("kernel tuning")
  fields = dataclasses.asdict(tuning)
  fields["prefetch_hint"] = HINTS.index(tuning.prefetch_hint)
  ffi_module().set_kernel_tuning(**fields)


def current() -> Tuning:
  """The tuning in effect."""
  require("kernel tuning")
  fields = dict(ffi_module().kernel_tuning())
  fields["prefetch_hint"] = HINTS[fields["prefetch_hint"]]
  return Tuning(**fields)


# The variants each stage tries (the fields it leaves out stay at the earlier stages' choice).
PREFETCH_BYTES = (0, 3072, 6144, 12288)
ROW_ACCUMULATORS = (4, 8)
GEMV_TASK_KIB = (256, 1024, 4096, 8192)  # the default is 2048
BLOCK_ROWS = (1, 2, 3, 4)
BATCH_TOKENS = (4, 8)
# A variant replaces its stage's baseline only when it takes less than 1 - MARGIN of its time:
# on the 2-core AVX2 Zen 3 VM, the same settings measured as two variants (medians of 7-15
# alternating rounds) differed by 4-5% (benchmarks/results/kernel_tuning_avx2.json).
MARGIN = 0.05
# The measured weights: twice the last-level cache, within these bounds.
MIN_WORKLOAD_BYTES = 128 << 20
MAX_WORKLOAD_BYTES = 1 << 30


def workload_bytes(llc_bytes: int | None = None) -> int:
  """Bytes of the GEMV weight and of the expert bank that a tuning run reads: twice the largest
  CPU cache (``last_level_cache_bytes``), at least 128 MiB and at most 1 GiB."""
  llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
  return min(max(MIN_WORKLOAD_BYTES, 2 * llc), MAX_WORKLOAD_BYTES)


def one_token_variants() -> list[Tuning]:
  """Stage 1: prefetch distance x hint x accumulators (the hint alone when nothing is
  prefetched)."""
  out = []
  for ahead in PREFETCH_BYTES:
    for hint in ("nta", "l2") if ahead else ("auto",):
      out.extend(Tuning(prefetch_bytes=ahead, prefetch_hint=hint, row_accumulators=acc)
                 for acc in ROW_ACCUMULATORS)
  return out


def candidates() -> list[Tuning]:
  """Every variant a tuning run can choose, field by field (for tests: each must be exact)."""
  return ([DEFAULT] + one_token_variants() + [Tuning(gemv_task_kib=k) for k in GEMV_TASK_KIB]
          + [Tuning(block_rows=r) for r in BLOCK_ROWS])


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The shapes measured: the model's hidden width, its experts' width and top-k. Smaller ones
  are raised to 1024 / 256 / 2 (kernels on tinier rows are bound by call overheads, which no
  variant changes)."""

  hidden: int
  ffn: int
  top_k: int

  def clamped(self) -> Shapes:
    return Shapes(max(self.hidden, 1024), max(self.ffn, 256), max(self.top_k, 2))


def machine_key() -> dict:
  """What a tuning is valid for: the CPU, the ISA and threads the kernels use now, the build."""
  info = cpu_info()
  cpu = cpu_model()
  return {"cpu": cpu["name"], "family": cpu["family"], "model": cpu["model"],
          "isa": info["isa"], "threads": info["threads"], "ftjax": ftjax_version(),
          "build": build_digest()}


def default_path(shapes: Shapes, bf16_activations: bool, key: dict | None = None) -> str:
  """``$FTJAX_CACHE_DIR/kernel_tuning/<cpu>-<family>-<model>-<isa>-<threads>t-<version>-<build>
  -h<hidden>f<ffn>k<top_k>-<bf16|f32>.json`` for ``shapes`` (clamped) and ``key`` (default: this
  machine's): a model of other shapes, or the other activations, has a tuning of its own."""
  key = key or machine_key()
  shapes = shapes.clamped()
  slug = re.sub(r"[^A-Za-z0-9.]+", "_", key["cpu"]).strip("_") or "cpu"
  name = (f"{slug}-f{key['family']}m{key['model']}-{key['isa']}-{key['threads']}t-"
          f"{key['ftjax']}-{key['build']}-h{shapes.hidden}f{shapes.ffn}k{shapes.top_k}-"
          f"{'bf16' if bf16_activations else 'f32'}.json")
  return os.path.join(paths.cache_root(), "kernel_tuning", name)


def _bf16_bits(n: int, seed: int) -> np.ndarray:
  """n bfloat16 values in [-0.03, 0.03], from a repeated 1 MiB random block (timing only)."""
  block = (np.random.default_rng(seed).uniform(-0.03, 0.03, 1 << 19).astype(np.float32)
           .view(np.uint32) >> 16).astype(np.uint16)
  return np.resize(block, n).view(jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(2,))
def _gemv(x, w, fast):
  return dense(x, w, bf16_activations=fast)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _experts(x, ids, route_w, bank, ffn, fast):
  def step(x, ids_t):
    y = expert_ffn(x, ids_t, route_w, bank, jnp.int32(0), ffn_dim=ffn, bf16_activations=fast)
    return x + 1e-30 * y, None
  return jax.lax.scan(step, x, ids)[0]


class Workloads:
  """The measured calls, each a jitted chain of kernel calls (no Python between them)."""

  def __init__(self, shapes: Shapes, bytes_each: int, bf16_activations: bool):
    D, F, K = shapes.hidden, shapes.ffn, shapes.top_k
    self.gemv_rows = max(bytes_each // (2 * D), 64)
    self.w = jnp.asarray(_bf16_bits(self.gemv_rows * D, 0).reshape(self.gemv_rows, D))
    expert_bytes = 3 * F * D * 2
    experts = max(bytes_each // expert_bytes, 2 * K)
    self.bank = jnp.asarray(_bf16_bits(experts * 3 * F * D, 1).reshape(1, experts, 3 * F * D))
    rng = np.random.default_rng(2)
    calls = max(experts // K, 2)
    self.ids = jnp.asarray(np.stack([rng.choice(experts, K, replace=False)[None]
                                     for _ in range(calls)]).astype(np.int32))
    self.route_w = jnp.full((1, K), 1.0 / K, jnp.float32)
    self.x = {t: jnp.asarray(rng.standard_normal((t, D), dtype=np.float32))
              for t in (1, *BATCH_TOKENS)}
    self.ffn, self.fast = F, bf16_activations
    self.bytes = {"gemv": self.w.nbytes, "experts": calls * K * expert_bytes,
                  **{f"batch{t}": self.w.nbytes for t in BATCH_TOKENS}}

  def run(self, name: str):
    if name == "gemv":
      return _gemv(self.x[1], self.w, self.fast)
    if name == "experts":
      return _experts(self.x[1], self.ids, self.route_w, self.bank, self.ffn, self.fast)
    return _gemv(self.x[int(name.removeprefix("batch"))], self.w, self.fast)

  def seconds(self, name: str) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(self.run(name))
    return time.perf_counter() - t0

  def read_gb_s(self) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(read_probe(self.w))
    return self.w.nbytes / (time.perf_counter() - t0) / 1e9


def _stage(work: Workloads, base: Tuning, variants: list[Tuning], names: tuple[str, ...],
           rounds: int, progress: Progress, reads: list[float]) -> tuple[Tuning, list[dict]]:
  """Times each variant (``base`` with its fields) on ``names`` in alternating rounds; returns
  the one with the lowest mean time relative to the first variant's (the baseline, kept unless
  another is faster by MARGIN), and every measurement."""
  merged = [dataclasses.replace(base, **{f.name: getattr(v, f.name)
                                         for f in dataclasses.fields(v)
                                         if getattr(v, f.name) != getattr(DEFAULT, f.name)})
            for v in variants]
  times = {(i, n): [] for i in range(len(merged)) for n in names}
  order = np.random.default_rng(3)
  for _ in range(rounds):
    reads.append(work.read_gb_s())
    for i in order.permutation(len(merged)):
      apply(merged[i])
      for n in names:
        times[(i, n)].append(work.seconds(n))
      progress.update(1)
  medians = {key: statistics.median(ts) for key, ts in times.items()}
  scores = [statistics.fmean(medians[(i, n)] / medians[(0, n)] for n in names)
            for i in range(len(merged))]
  best = int(np.argmin(scores))
  if scores[best] > 1 - MARGIN:  # within the noise of the baseline: keep it
    best = 0
  read = statistics.median(reads)
  rows = [{"variant": merged[i].name, "fields": dataclasses.asdict(merged[i]),
           "score": scores[i],
           **{f"{n}_ms": 1e3 * medians[(i, n)] for n in names},
           **{f"{n}_to_read": work.bytes[n] / medians[(i, n)] / 1e9 / read for n in names}}
          for i in range(len(merged))]
  return merged[best], rows


def measure(shapes: Shapes, *, rounds: int = 5, bf16_activations: bool = False,
            bytes_each: int | None = None, show_progress: bool = True) -> dict:
  """Measures the variants on ``shapes`` (clamped, ``Shapes``) and returns the tuning record:
  {"version", "key", "chosen", "name", "shapes", "bf16_activations", "read_gb_s", "bytes_each",
  "llc_bytes", "stages", "seconds", "created"}. Leaves the chosen tuning applied.
  ``bytes_each``: the size of the GEMV weight and of the expert bank (default
  ``workload_bytes()``: past the last-level cache)."""
  t0 = time.perf_counter()
  key = machine_key()
  shapes = shapes.clamped()
  llc = last_level_cache_bytes()
  bytes_each = workload_bytes(llc) if bytes_each is None else bytes_each
  work = Workloads(shapes, bytes_each, bf16_activations)
  previous = current()
  stage1 = one_token_variants()
  total = rounds * (len(stage1) + len(GEMV_TASK_KIB) + len(BLOCK_ROWS) + 2)  # + the baselines,
  # less the ISA's own block rows
  progress = Progress(total, desc=f"tuning the kernels ({key['isa']}, {key['threads']} threads)",
                      enabled=show_progress)
  try:
    apply(DEFAULT)
    for name in work.bytes:  # compile and pre-fault
      work.seconds(name)
    reads: list[float] = []
    chosen, one_token = _stage(work, DEFAULT, [DEFAULT] + stage1, ("gemv", "experts"), rounds,
                               progress, reads)
    chosen, gemv_tasks = _stage(work, chosen, [DEFAULT] + [Tuning(gemv_task_kib=k)
                                                           for k in GEMV_TASK_KIB],
                                ("gemv",), rounds, progress, reads)
    batch = tuple(f"batch{t}" for t in BATCH_TOKENS)
    own_rows = 4 if key["isa"].startswith("avx512") else 2  # the ISA's default (registers)
    chosen, blocks = _stage(work, chosen, [DEFAULT] + [Tuning(block_rows=r) for r in BLOCK_ROWS
                                                       if r != own_rows],
                            batch, rounds, progress, reads)
  except BaseException:
    apply(previous)
    raise
  finally:
    progress.close()
  apply(chosen)
  return {"version": FILE_VERSION, "key": key, "chosen": dataclasses.asdict(chosen),
          "name": chosen.name, "shapes": dataclasses.asdict(shapes),
          "bf16_activations": bf16_activations, "read_gb_s": statistics.median(reads),
          "bytes_each": bytes_each, "llc_bytes": llc,
          "stages": {"one_token": one_token, "gemv_tasks": gemv_tasks, "blocks": blocks},
          "seconds": time.perf_counter() - t0,
          "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save(record: dict, path: str | None = None) -> str:
  """Writes ``record`` to ``path`` (default: the ``default_path`` of its key and shapes)
  atomically."""
  path = path or default_path(Shapes(**record["shapes"]), record["bf16_activations"],
                              record["key"])
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, path)
  return path


def load(path: str) -> tuple[Tuning, dict]:
  """The tuning in the file at ``path`` and its record. Raises FileNotFoundError or ValueError,
  naming the problem and the fix, for a missing or malformed file or one measured on another
  machine, ISA, thread count or build."""
  fix = "measure this machine's with --kernel_tuning=auto or python -m ftjax.profile"
  if not os.path.isfile(path):
    raise FileNotFoundError(f"kernel tuning file {path} does not exist: {fix}")
  try:
    with open(path) as f:
      record = json.load(f)
    tuning = Tuning.from_dict(record["chosen"])
    key = record["key"]
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise ValueError(f"kernel tuning file {path} is not a tuning record ({error}): {fix}") from None
  here = machine_key()
  differ = [f"{k} {key.get(k)!r} (here {here[k]!r})" for k in here if key.get(k) != here[k]]
  if differ:
    raise ValueError(f"kernel tuning file {path} was measured elsewhere: {', '.join(differ)}; "
                     f"{fix}")
  return tuning, record


def resolve(mode: str, shapes: Shapes, *, bf16_activations: bool = False,
            log=None) -> tuple[Tuning, str]:
  """Applies the tuning ``mode`` names (``MODES_HELP``) and returns it with a description for
  the summary line. ``auto`` without a file measures (progress on stderr) and writes one;
  ``log`` (default: stderr) hears about it."""
  log = log or (lambda line: print(line, file=sys.stderr))
  if mode == "off":
    apply(DEFAULT)
    return DEFAULT, "default (--kernel_tuning=off)"
  if mode != "auto":
    tuning, record = load(mode)
    apply(tuning)
    return tuning, f"{tuning.name} (from {mode})"
  key = machine_key()
  if key["isa"] not in SIMD_ISAS:
    apply(DEFAULT)
    return DEFAULT, f"default ({key['isa']} kernels: nothing to tune)"
  path = default_path(shapes, bf16_activations, key)
  if os.path.isfile(path):
    tuning, record = load(path)
    apply(tuning)
    return tuning, f"{tuning.name} (tuned {record['created'][:10]}, {path})"
  s = shapes.clamped()
  log(f"no kernel tuning for this machine and shape yet ({key['cpu']}, {key['isa']}, "
      f"{key['threads']} threads; hidden {s.hidden}, experts {s.ffn}, top-{s.top_k}, "
      f"{'bf16' if bf16_activations else 'float32'} activations): measuring the kernels' "
      f"variants once; {path} keeps the result")
  record = measure(shapes, bf16_activations=bf16_activations)
  save(record, path)
  return Tuning.from_dict(record["chosen"]), (f"{record['name']} (tuned now in "
                                              f"{record['seconds']:.1f} s, {path})")
