"""Persistent caches of ftjax's programs for its commands: a restart compiles nothing it
compiled before, and a warm start does not even trace them.

``enable(directory=None)`` points JAX's persistent compilation cache at
``$FTJAX_CACHE_DIR/xla/<build>`` (``FTJAX_CACHE_DIR`` defaults to ``~/.cache/ftjax``, where
converted weights live too), and caches every program whatever its compile time. JAX's own key
already covers the program (its HLO, so the model's shapes and the runtime flags that change
it), jax and jaxlib, the backend, the device and XLA's flags. ``<build>`` adds what that key
cannot see: ftjax's version and its compiled C++ modules (the FFI kernels a program calls by
name), so a rebuilt ftjax never loads an executable made against another build, and the CPU's
model and instruction-set flags (XLA:CPU compiles for the host's ISA).

JAX consults its cache only after a program is traced and lowered, which on a 40-layer model
is most of a warm start (seconds per program). So ``enable`` also turns on a store of whole
executables (``$FTJAX_CACHE_DIR/executables/<build>``), which ``Programs.compile`` reads before
it traces anything: ``load_executable(fingerprint(...))``. A program's fingerprint
(``fingerprint``) is a digest of everything its compile depends on that JAX's key would have
seen in the lowered module, without lowering it:

- the build (``build_key``) and a digest of ftjax's Python sources (``source_digest``: a
  changed line of the model changes every fingerprint);
- jax and jaxlib, the backend, its devices, JAX's configuration (all but the caches' and
  logging's options) and the environment's ``FTJAX_*``, ``JAX_*`` and ``XLA_*`` variables;
- the ``Runner`` (the model's structure and static attributes, the kernels, the policy...),
  the program's kind and its static options, and each argument's tree, shape, dtype, weak type
  and sharding.

Where any of those has no stable description (an object printed with its address), the
program is compiled and not stored, and that is said once on stderr. A stored file that does
not load (partial, corrupt, from another jaxlib) is said on stderr, removed and compiled
again, never used. Files are written whole (a temporary file renamed), so a crash leaves none
partial.

Only a program XLA has just compiled is stored. One that JAX's own cache served is not: an
XLA:CPU executable loaded from a serialized form does not serialize again whole (measured: the
copy loads, then fails at its first run with "Function gather_convert_fusion not found"), so
``compile_program`` watches JAX's cache-hit event (``jax.monitoring``) and stores nothing
then, and says so. That happens only where JAX's cache holds a program this store lacks (a
removed or damaged file, or a ``JAX_COMPILATION_CACHE_DIR`` filled by another run); each start
then traces that program, as without this store.

``python -m ftjax.decode``, ``ftjax.chat`` and ``ftjax.serve`` call it at start-up
(``--compilation_cache``, on by default; ``--nocompilation_cache`` turns both off). A
``JAX_COMPILATION_CACHE_DIR`` set in the environment wins: it is used as it is, and the
executables go in its ``ftjax-executables/<build>``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import re
import sys
import tempfile
import threading
import weakref

import jax
import jaxlib
from jax.experimental import serialize_executable

from ftjax.kernels.cpu_info import build_digest, cpu_identity, ftjax_version
from ftjax.utils import paths

__all__ = ["build_key", "compiler_options", "cpu_identity", "default_root", "disable_executables", "enable",
           "enable_executables", "executables_dir", "compile_program", "fingerprint", "ftjax_version", "load_executable",
           "save_executable", "source_digest"]


def default_root() -> str:
  return paths.cache_root()


def _usable_cpus() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def build_key() -> str:
  """ftjax's version and a digest of its compiled modules (name, size, mtime) and of the CPU
  (its model and instruction-set flags: XLA:CPU compiles for the host's ISA, and a cache
  directory shared by machines with different ones must not hand an AVX-512 program to an
  AVX2 machine), and how many CPUs the process may use: XLA:CPU splits fusions across as many
  threads as it finds at compile time (``outer_dimension_partitions``), and an executable
  compiled under one CPU keeps that. (What made such programs 10-40x slower was the KV write,
  since fixed: ``ftjax.model.layers.KV_BITS``.) A directory given to ``enable`` or in
  ``JAX_COMPILATION_CACHE_DIR`` is used as it is, without this key: JAX's own cache key does
  not count the CPUs, so such a directory must not be shared across CPU counts."""
  version = ftjax_version()
  digest = hashlib.sha256(version.encode())
  digest.update(build_digest().encode())
  digest.update(cpu_identity().encode())
  digest.update(f"cpus {_usable_cpus()}".encode())
  return f"ftjax-{version}-{digest.hexdigest()[:16]}"


def enable(directory: str | None = None, executables: bool = True) -> str:
  """Turns the persistent compilation cache on and returns its directory (created); with
  ``executables``, the store of whole executables too (``executables_dir``)."""
  given = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if given:
    path = given
    store = os.path.join(given, "ftjax-executables", build_key())
  else:
    path = directory or os.path.join(default_root(), "xla", build_key())
    store = (os.path.join(os.path.dirname(os.path.dirname(path)), "executables", build_key())
             if directory is None else os.path.join(directory, "ftjax-executables"))
  os.makedirs(path, exist_ok=True)
  if executables:
    enable_executables(store)
  else:
    disable_executables()
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: a server's start-up is made of many small ones.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


# -- Whole executables ---------------------------------------------------------------------------

_STORE: list[str | None] = [None]  # the executables' directory; None: not stored
_SAID: set[str] = set()  # what was already said on stderr (once each)
_LOCK = threading.Lock()
FORMAT = "ftjax-executable-v1"  # the files' layout: a new one never reads an older one's files
_UNSTABLE = re.compile(r" at 0x[0-9a-f]+|object at |<function |<lambda>")
# JAX options that cannot change a program: where caches live and what is logged.
_IGNORED_CONFIG = ("cache", "log", "explain", "debug_log")


def executables_dir() -> str | None:
  """Where whole executables are stored (``enable``), or None when they are not."""
  return _STORE[0]


def enable_executables(directory: str) -> str:
  """Stores and loads whole executables in ``directory`` (created) from now on, without
  touching JAX's own cache: what ``enable`` does for the commands, and what a library user or
  a test calls alone. Returns the directory."""
  os.makedirs(directory, exist_ok=True)
  _STORE[0] = directory
  return directory


def disable_executables() -> None:
  """Stops storing and loading whole executables (JAX's own cache stays as it is)."""
  _STORE[0] = None


def _say_once(message: str) -> None:
  with _LOCK:
    if message in _SAID:
      return
    _SAID.add(message)
  print(f"ftjax executables: {message}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
  """A digest of every Python source file of the ftjax package (path and contents)."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(package):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(root, name)
        digest.update(os.path.relpath(path, package).encode() + b"\0")
        with open(path, "rb") as f:
          digest.update(f.read())
  return digest.hexdigest()


def _environment() -> str:
  """What every program of this process depends on besides its own arguments: versions, the
  backend and its devices, JAX's options and the environment's FTJAX_/JAX_/XLA_ variables,
  read at each compile (a variable such as FTJAX_ISA set between two compiles keys the
  second by its new value)."""
  backend = jax.devices()[0].client
  options = sorted((k, repr(v)) for k, v in jax.config.values.items()
                   if not any(word in k for word in _IGNORED_CONFIG))
  env = sorted((k, v) for k, v in os.environ.items()
               if k.startswith(("FTJAX_", "JAX_", "XLA_")) and "CACHE" not in k)
  devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
  return repr((FORMAT, build_key(), source_digest(), jax.__version__, jaxlib.__version__,
               backend.platform, backend.platform_version, devices, options, env,
               sorted(compiler_options().items())))


def _describe_leaf(x) -> tuple:
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:  # a Python scalar: traced by its type, not its value
    return ("py", type(x).__name__)
  weak = getattr(x, "weak_type", None)
  if weak is None:
    aval = getattr(x, "aval", None)
    weak = getattr(aval, "weak_type", False)
  return (tuple(shape), str(dtype), bool(weak), repr(getattr(x, "sharding", None)))


_RUNNER_TEXT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _describe_runner(runner) -> str:
  """The runner's part of a fingerprint, kept per runner while it lives: at 40 layers its
  graph's text takes ~30 ms, and a server's start fingerprints each of its programs twice
  (``Programs.stored``, then ``Programs.compile``)."""
  try:
    return _RUNNER_TEXT[runner]
  except (KeyError, TypeError):
    pass
  graphdef = runner.graphdef
  rest = dataclasses.replace(runner, graphdef=None)
  text = repr((repr(graphdef.nodes), repr(graphdef.attributes), repr(rest)))
  try:
    _RUNNER_TEXT[runner] = text
  except TypeError:  # not weakly referable: described every time
    pass
  return text


def fingerprint(kind, runner, args: tuple, static: dict) -> str | None:
  """The digest that names a program's stored executable (the module docstring says what it
  covers), or None when the store is off or something it covers has no stable description
  (said once)."""
  if _STORE[0] is None:
    return None
  leaves, tree = jax.tree_util.tree_flatten(args)
  body = kind.body
  text = repr((kind.name, f"{body.__module__}.{body.__qualname__}", kind.static, kind.donate,
               sorted((k, repr(v)) for k, v in static.items()), _describe_runner(runner),
               repr(tree), [_describe_leaf(x) for x in leaves]))
  found = _UNSTABLE.search(text)
  if found:
    _say_once(f"the {kind.name} program is compiled, not stored: its description has an "
              f"object without a stable form ({text[max(0, found.start() - 60):found.end()]!r})")
    return None
  return hashlib.sha256((_environment() + text).encode()).hexdigest()


def _path(digest: str) -> str:
  return os.path.join(_STORE[0], digest[:2], digest + ".exe")


def is_stored(digest: str | None) -> bool:
  """Whether the store holds an executable named ``digest`` (``load_executable`` would try it)."""
  return digest is not None and _STORE[0] is not None and os.path.exists(_path(digest))


_HITS = threading.local()  # JAX persistent-cache hits of this thread's compiles
_LISTENING = [False]
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **_) -> None:
  if event == _HIT_EVENT:
    _HITS.count = getattr(_HITS, "count", 0) + 1


# XLA options every program is compiled with (``compiler_options``), on the CPU backend: no
# YNNPACK fusions. An XLA:CPU executable with them, loaded from a serialized form (this store, or
# JAX's persistent cache), ran far slower than the same program just compiled (jaxlib 0.10.2):
# the server's 4-row decode program of the default model took ~270 ms a chunk of 8 steps
# instead of ~8 (128 streamed tokens in 4.1-4.6 s against 0.11-0.17 s, Zen 5, 2 cores), on
# every warm start of `python -m ftjax.serve`. Without them the loaded program is as fast as a
# fresh one (0.20-0.28 s for those tokens; fresh 0.11-0.15 s), and a fresh one no slower: the
# work they fused (small dots and elementwise ops beside the C++ kernels) runs on XLA's own
# emitters instead.
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options() -> dict[str, str]:
  """The XLA options ftjax compiles its programs with on this process's backend."""
  return dict(_CPU_OPTIONS) if jax.default_backend() == "cpu" else {}


def compile_program(lowered, digest: str | None):
  """``lowered.compile()`` (a ``jax.stages.Lowered``) with ``compiler_options()``, stored
  under ``digest`` when XLA compiled it now rather than JAX's own cache serving it (the module
  docstring says why)."""
  options = compiler_options()
  if digest is None or _STORE[0] is None:
    return lowered.compile(compiler_options=options)
  with _LOCK:
    if not _LISTENING[0]:
      jax.monitoring.register_event_listener(_on_event)
      _LISTENING[0] = True
  before = getattr(_HITS, "count", 0)
  compiled = lowered.compile(compiler_options=options)
  if getattr(_HITS, "count", 0) > before:
    _say_once("JAX's persistent compilation cache served a program this store lacks; an "
              "executable loaded that way cannot be stored again whole (XLA:CPU), so it is "
              f"traced at every start until that cache ({jax.config.jax_compilation_cache_dir}) "
              "is cleared")
  else:
    save_executable(digest, compiled)
  return compiled


def load_executable(digest: str | None):
  """The stored executable named ``digest``, loaded, or None (not stored, or it did not load:
  said on stderr, and the caller compiles it)."""
  if digest is None or _STORE[0] is None:
    return None
  path = _path(digest)
  try:
    with open(path, "rb") as f:
      blob = f.read()
  except FileNotFoundError:
    return None
  except OSError as e:
    _say_once(f"{path} could not be read ({e}); compiling instead")
    return None
  try:
    magic, payload, in_tree, out_tree = pickle.loads(blob)
    if magic != FORMAT:
      raise ValueError(f"format {magic!r}, not {FORMAT!r}")
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except Exception as e:  # noqa: BLE001 - a bad file is compiled again, whatever broke
    _say_once(f"{path} did not load ({type(e).__name__}: {str(e)[:200]}); removed, compiling "
              "instead")
    try:
      os.unlink(path)
    except OSError:
      pass
    return None


def save_executable(digest: str | None, compiled) -> bool:
  """Stores ``compiled`` (a ``jax.stages.Compiled``) under ``digest``, whole or not at all (a
  temporary file renamed). False where it cannot be serialized or written (said once)."""
  if digest is None or _STORE[0] is None:
    return False
  try:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    blob = pickle.dumps((FORMAT, payload, in_tree, out_tree))
  except Exception as e:  # noqa: BLE001 - not every executable serializes; it still runs
    _say_once(f"an executable could not be serialized ({type(e).__name__}: {str(e)[:200]}); "
              "it is compiled at every start")
    return False
  path = _path(digest)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partial-")
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(blob)
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise
  except OSError as e:
    _say_once(f"could not write {path} ({e}); executables are compiled at every start")
    return False
  return True
