"""The package's layering, read from its sources with ``ast``: imports run one way, and no
module uses another's private (underscored) names.

  runtime -> model, runtime -> cache -> experts -> kernels, model -> kernels (dense ops only:
  GEMV/GEMM, attention and the delta-rule step),
  research -> runtime (and below), server -> runtime, and nothing below imports what is above
  it.

A subpackage may import only the subpackages listed for it in ``ALLOWED``; the modules at the
package root (``ftjax/__init__.py``, the CLIs and the public aliases) are entry points that may
import anything and that nothing in a subpackage imports. Every ``ftjax`` import sits at module
level (a function-local one would only hide an edge from this check), and the module graph
has no cycle. The checker is tested on hand-made module sets too, so this test can fail.
"""

from __future__ import annotations

import ast
import os

import pytest

import ftjax

ROOT = os.path.dirname(os.path.abspath(ftjax.__file__))

ALLOWED = {
    "utils": set(),
    "assets": set(),
    "kernels": {"utils"},
    "experts": {"kernels", "utils"},
    "model": {"kernels", "utils"},
    "formats": {"model", "utils"},
    "cache": {"experts", "kernels", "utils"},
    "runtime": {"model", "cache", "experts", "kernels", "formats", "utils", "assets"},
    "research": {"runtime", "model", "cache", "experts", "kernels", "formats", "utils",
                 "assets"},
    "tiny": {"research", "runtime", "model", "experts", "formats", "utils", "assets"},
    "server": {"runtime", "utils", "assets"},
}
# Compiled extension modules (no .py source) and the layer they belong to.
EXTENSIONS = {"ftjax._ffi": "kernels", "ftjax._ffi_cuda": "kernels"}
# What the model may take from the kernels: its dense ops (GEMV/GEMM, attention, the Gated
# DeltaNet's delta-rule step), never the expert kernels (the routed experts come as an argument).
MODEL_KERNELS = {"ftjax.kernels", "ftjax.kernels.dense", "ftjax.kernels.attention",
                 "ftjax.kernels.delta_rule"}
MODEL_KERNEL_NAMES = {"dense", "attention", "delta_rule_step"}


def read_package(root: str) -> dict[str, str]:
  """Module name -> source, for every .py file under ``root`` (a package named ftjax)."""
  sources = {}
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        parts = os.path.relpath(path, root)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        with open(path, encoding="utf-8") as f:
          sources[".".join(["ftjax", *parts])] = f.read()
  return sources


def imports(module: str, source: str, modules: set[str]):
  """(target module, imported names, is module level, line) for each ftjax import."""
  tree = ast.parse(source)
  nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                             ast.Lambda))
            for n in ast.walk(f) if n is not f}
  package = module if f"{module}.__init__" in modules or _is_package(module, modules) else (
      module.rsplit(".", 1)[0])
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "ftjax":
          yield _resolve(alias.name, modules), set(), id(node) not in nested, node.lineno
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                        ([base] if base else []))
      if base.split(".")[0] != "ftjax":
        continue
      names = {a.name for a in node.names}
      for name in names:  # `from ftjax.x import sub` imports the submodule ftjax.x.sub
        full = f"{base}.{name}"
        target = full if full in modules or full in EXTENSIONS else _resolve(base, modules)
        yield target, {name}, id(node) not in nested, node.lineno


def _is_package(module: str, modules: set[str]) -> bool:
  return any(m.startswith(module + ".") for m in modules)


def _resolve(name: str, modules: set[str]) -> str:
  while name not in modules and name not in EXTENSIONS and "." in name:
    name = name.rsplit(".", 1)[0]
  return name


def layer(module: str) -> str | None:
  """The subpackage a module belongs to; None for the entry modules at the root."""
  if module in EXTENSIONS:
    return EXTENSIONS[module]
  parts = module.split(".")
  if len(parts) < 2 or parts[1] not in ALLOWED:
    return None
  return parts[1]


def violations(sources: dict[str, str]) -> list[str]:
  modules = set(sources)
  found = []
  graph: dict[str, set[str]] = {m: set() for m in modules}
  for module, source in sources.items():
    here = layer(module)
    for target, names, module_level, line in imports(module, source, modules):
      if target == module:
        continue
      graph[module].add(target)
      where = f"{module}:{line} imports {target}"
      if not module_level:
        found.append(f"{where} inside a function (imports of ftjax modules go at the top)")
      there = layer(target)
      if here is None:
        continue  # entry modules may import anything
      if there is None:
        found.append(f"{where}: an entry module, which nothing in a subpackage may import")
      elif there != here and there not in ALLOWED[here]:
        found.append(f"{where}: {here} may not import {there}")
      elif here == "model" and there == "kernels" and not (
          target in MODEL_KERNELS and names <= MODEL_KERNEL_NAMES):
        found.append(f"{where} {sorted(names)}: the model takes dense ops only from kernels")
  found += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
  return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component) + [sorted(component)[0]])

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


# The public API of named tuples, underscored so as not to clash with field names.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def private_uses(sources: dict[str, str]) -> list[str]:
  """Private names used outside their owner: ``from ftjax.x import _name``, and ``obj._name``
  for any ``obj`` but ``self`` and ``cls``, even where the module defines a ``_name`` of its own
  (another instance's private state is not the module's to touch either: it goes through a
  public method or the constructor). Underscored names are their owner's: everyone else uses
  its public API."""
  found = []
  for module, source in sources.items():
    tree = ast.parse(source)
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ftjax"):
        for alias in node.names:
          if alias.name.startswith("_") and not alias.name.startswith("__"):
            found.append(f"{module}:{node.lineno} imports the private {node.module}."
                         f"{alias.name}")
      elif isinstance(node, ast.Attribute):
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in NAMEDTUPLE_API:
          continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
          continue
        found.append(f"{module}:{node.lineno} uses a private name of another object "
                     f"{ast.unparse(node)}")
  return found


def test_no_private_name_is_used_across_modules():
  assert private_uses(read_package(ROOT)) == []


@pytest.mark.parametrize("sources,expected", [
    ({"ftjax.runtime.a": "from ftjax.runtime.b import _helper", "ftjax.runtime.b": ""},
     "imports the private ftjax.runtime.b._helper"),
    ({"ftjax.runtime.a": "def f(engine):\n  return engine._keep(1)\n",
      "ftjax.runtime.b": "class E:\n  def _keep(self, x):\n    return x\n"},
     "private name of another object engine._keep"),
    # The module defines _keep too: another object's is still not its to use.
    ({"ftjax.runtime.a": "class S:\n  def _keep(self):\n    return 1\n"
                         "  def copy(self, other):\n    return other._keep()\n"},
     "private name of another object other._keep"),
])
def test_private_checker_finds_each_kind(sources, expected):
  found = private_uses(sources)
  assert any(expected in v for v in found), found
  module = "ftjax.runtime.a"
  assert all(v.startswith(module) for v in found)


def test_allowed_directions_have_no_cycle():
  graph = {k: set(v) for k, v in ALLOWED.items()}
  assert cycles(graph) == []


def test_package_imports_run_one_way():
  sources = read_package(ROOT)
  assert {"ftjax.runtime.engine", "ftjax.model.transformer", "ftjax.cache.policy",
          "ftjax.experts.routed", "ftjax.research.sweep"} <= set(sources)
  assert violations(sources) == []


@pytest.mark.parametrize("sources,expected", [
    ({"ftjax.cache.a": "from ftjax.model import b", "ftjax.model.b": ""},
     "cache may not import model"),
    ({"ftjax.model.a": "from ftjax.cache import b", "ftjax.cache.b": ""},
     "model may not import cache"),
    ({"ftjax.model.a": "from ftjax.kernels import expert_ffn", "ftjax.kernels": ""},
     "the model takes dense ops only"),
    ({"ftjax.runtime.a": "def f():\n  from ftjax.runtime import b\n", "ftjax.runtime.b": ""},
     "inside a function"),
    ({"ftjax.runtime.a": "import ftjax.runtime.b", "ftjax.runtime.b": "from ftjax.runtime import a"},
     "import cycle: ftjax.runtime.a -> ftjax.runtime.b -> ftjax.runtime.a"),
    ({"ftjax.cache.a": "from ftjax import decode", "ftjax.decode": ""},
     "an entry module"),
    ({"ftjax.kernels.a": "from ftjax.research import b", "ftjax.research.b": ""},
     "kernels may not import research"),
])
def test_checker_finds_each_kind_of_violation(sources, expected):
  found = violations(sources)
  assert any(expected in v for v in found), found


def test_checker_accepts_allowed_imports():
  sources = {"ftjax.runtime.a": "from ftjax.cache import b\nimport ftjax.model.c",
             "ftjax.cache.b": "from ftjax.experts import d", "ftjax.model.c": "",
             "ftjax.experts.d": "from ftjax.kernels import e", "ftjax.kernels.e": "",
             "ftjax.model.f": "from ftjax.kernels import dense", "ftjax.kernels": "",
             "ftjax.decode": "from ftjax.research import g\nimport ftjax",
             "ftjax.research.g": "from ftjax.runtime import a", "ftjax": ""}
  assert violations(sources) == []
