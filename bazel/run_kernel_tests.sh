#!/bin/sh
# Runs tests/kernels against the Bazel-built module instead of the pip-installed ftjax._ffi:
#
#   PYTHON_BIN_PATH=/path/to/venv/bin/python bazel build -c opt //xla_ffi:all
#   PYTHON_BIN_PATH=/path/to/venv/bin/python bazel/run_kernel_tests.sh [pytest options]
#
# Copies the ftjax package (src/ftjax) from this checkout into a temporary directory, puts
# bazel-bin/xla_ffi/_ffi<suffix>.so into it, and runs pytest with that copy first on the path.
# The environment needs ftjax's test dependencies (pytest, hypothesis, ...).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON_BIN_PATH:-python3}
module=$(ls "$root"/bazel-bin/xla_ffi/_ffi.*so 2>/dev/null | head -n 1)
if [ -z "$module" ]; then
  echo "$0: no bazel-bin/xla_ffi/_ffi.*so; build //xla_ffi:all first" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -R "$root/src/ftjax" "$work/ftjax"
rm -f "$work"/ftjax/_ffi*.so
cp "$module" "$work/ftjax/"
cd "$work"
PYTHONPATH="$work" "$python" -c "
import ftjax._ffi
assert ftjax._ffi.__file__.startswith('$work/'), ftjax._ffi.__file__
print('testing the Bazel-built', '$module', 'with handlers', sorted(ftjax._ffi.registrations()))"
PYTHONPATH="$work" exec "$python" -m pytest -p no:cacheprovider "$root/tests/kernels" "$@"
