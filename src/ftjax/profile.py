"""``python -m ftjax.profile``: measure this machine's bandwidths (B_H, B_P, read ceiling).

  python -m ftjax.profile --out=profile.json                     # Qwen3-30B-A3B expert shape
  python -m ftjax.profile --model=DIR --out=profile.json         # the model's expert shape
  python -m ftjax.profile --hidden=4096 --ffn=14336 --top_k=2    # any shape
  python -m ftjax.profile --hardware_out=configs/hardware/mine.yaml --name=mine

It first measures the C++ kernels' variants on the shape (``ftjax.kernels.tuning``: prefetch,
accumulators, tasks, register blocks), keeps the fastest in this machine's tuning file (which
``--kernel_tuning=auto`` reads), and measures the bandwidths with it; ``--notune_kernels`` skips
that.

``--hardware_out`` also writes this machine as a cost-model hardware profile (YAML, see
``configs/hardware/README.md``): the measured bandwidths, and fixed overheads calibrated from
a short cpu_only decode of ``--model`` (or, without it, of a small random model with the
profiled expert shape: ``ftjax.research.calibrate.calibration_model``).
"""

import socket

from absl import app, flags, logging

import ftjax
from ftjax.kernels import tuning
from ftjax.research import calibrate
from ftjax.runtime import profile as profile_lib

_MODEL = flags.DEFINE_string("model", None, "FTW model directory: profile its own expert bank")
_HIDDEN = flags.DEFINE_integer("hidden", 2048, "expert input width D (without --model)",
                               lower_bound=1)
_FFN = flags.DEFINE_integer("ffn", 768, "expert hidden width F (without --model)", lower_bound=1)
_TOP_K = flags.DEFINE_integer("top_k", 8, "experts per call (without --model)", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "int8", "mxfp4"],
                            "expert format of the synthetic bank (int8, mxfp4: docs/ftw.md)")
_BANK_GB = flags.DEFINE_float("bank_gb", 1.0, "synthetic bank size (without --model)")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "alternating measurement rounds", lower_bound=1)
_OUT = flags.DEFINE_string("out", "ftjax_profile.json", "where to write the JSON profile")
_HARDWARE_OUT = flags.DEFINE_string("hardware_out", None,
                                    "also write a cost-model hardware profile (YAML) here")
_NAME = flags.DEFINE_string("name", None, "name of the hardware profile (default: the host name)")
_OVERHEAD_TOKENS = flags.DEFINE_integer("overhead_tokens", 8, "decode tokens that calibrate the "
                                        "fixed overheads (with --hardware_out)", lower_bound=1)
_TUNE = flags.DEFINE_boolean("tune_kernels", True, "measure the kernels' variants first and "
                             "keep the fastest in this machine's tuning file")
_TUNE_ROUNDS = flags.DEFINE_integer("tune_rounds", 5, "alternating rounds of the kernel tuning",
                                    lower_bound=1)


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  try:
    if _MODEL.value:
      model = ftjax.load(_MODEL.value, verify=False, populate=True)
      c = model.config
      shape = profile_lib.ExpertShape(c.hidden_size, c.moe_intermediate_size, model.expert_format,
                                      c.top_k, bias=profile_lib.expert_shape_bias(
                                          c, model.expert_format))
      bank = model.bank
    else:
      model = None
      shape = profile_lib.ExpertShape(_HIDDEN.value, _FFN.value, _DTYPE.value, _TOP_K.value)
      bank = profile_lib.synthetic_bank(shape, int(_BANK_GB.value * 1e9))
    if _TUNE.value:
      record = tuning.measure(tuning.Shapes(shape.hidden, shape.ffn, shape.top_k),
                              rounds=_TUNE_ROUNDS.value,
                              bf16_activations=shape.dtype == "bfloat16")
      print(_tuning_summary(record))
      print(f"wrote {tuning.save(record)}")
    result = profile_lib.measure(bank, shape, rounds=_ROUNDS.value)
    result["kernel_tuning"] = tuning.current().name
    if _HARDWARE_OUT.value:
      del bank
      hardware = _hardware_profile(result, shape, model)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"ftjax.profile: error: {e}") from None
  path = profile_lib.save_profile(result, _OUT.value)
  c = result["concurrent"]
  print(f"read {result['read_gb_s']:.1f} GB/s | B_H {result['b_h_gb_s']:.1f} GB/s "
        f"({result['b_h_gb_s'] / result['read_gb_s']:.2f} of read) | B_P "
        f"{result['b_p_gb_s']:.1f} GB/s | concurrent B_H {c['b_h_gb_s']:.1f} + B_P "
        f"{c['b_p_gb_s']:.1f} GB/s")
  print(f"wrote {path}")
  if _HARDWARE_OUT.value:
    print(f"overheads: {hardware.layer_overhead_s * 1e6:.1f} us per layer, "
          f"{hardware.step_overhead_s * 1e6:.1f} us per token")
    print(f"wrote {hardware.save(_HARDWARE_OUT.value)}")


def _tuning_summary(record: dict) -> str:
  """The chosen variant and each stage's spread (best and worst against the default)."""
  lines = [f"kernel tuning ({record['key']['isa']}, {record['key']['threads']} threads, "
           f"{record['seconds']:.1f} s): {record['name']}"]
  for stage, rows in record["stages"].items():
    scores = sorted((row["score"], row["variant"]) for row in rows)
    lines.append(f"  {stage}: best {scores[0][1]} {scores[0][0]:.3f}, worst {scores[-1][1]} "
                 f"{scores[-1][0]:.3f} of the time of {rows[0]['variant']}")
  return "\n".join(lines)


def _hardware_profile(result, shape, model):
  """The cost-model profile of this machine, overheads calibrated on ``model`` (or on a small
  random model of the profiled expert shape)."""
  name = _NAME.value or socket.gethostname()
  calibrated_on = f"model {_MODEL.value}"
  if model is None:
    model = calibrate.calibration_model(shape)
    calibrated_on = (f"a random {model.config.num_layers}-layer model of this expert shape "
                     f"(D={shape.hidden}, F={shape.ffn}, {shape.dtype})")
  bare = calibrate.hardware_profile(result, name)
  over = calibrate.measure_overheads(model, bare, tokens=_OVERHEAD_TOKENS.value)
  return calibrate.hardware_profile(
      result, name, layer_overhead_s=over["layer_overhead_s"],
      step_overhead_s=over["step_overhead_s"],
      source=f"overheads calibrated from {over['steps']} cpu_only decode steps of {calibrated_on}")


if __name__ == "__main__":
  app.run(main)
