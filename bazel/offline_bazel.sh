#!/bin/sh
# Runs Bazel for an offline build with Debian's bazel-bootstrap 4.2.3 (no network, no distdir):
#
#   PYTHON_BIN_PATH=/path/to/venv/bin/python bazel/offline_bazel.sh build -c opt //xla_ffi:all
#
# Bazel's default WORKSPACE suffix declares @rules_cc and @rules_java as http_archives, and
# @bazel_tools loads both for any C++ build (bazel/offline/*/defs.bzl say where). This points
# them at the local stand-ins in bazel/offline/ instead of downloading them. The paths must
# be absolute (Bazel 4.2.3 does not expand %workspace% in --override_repository), hence a
# script rather than a bazelrc.
#
# Debian's linux-sandbox prints its debug log (~40 lines) for every action; the
# process-wrapper sandbox still runs each action in its own execroot, quietly.
set -eu
if [ "$#" -lt 1 ]; then
  echo "usage: $0 <bazel command> [options] [targets]   e.g. $0 build -c opt //xla_ffi:all" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
command=$1
shift
case "$command" in
  build | test | run | coverage) set -- --spawn_strategy=processwrapper-sandbox "$@" ;;
esac
exec "${BAZEL:-bazel}" "$command" \
  --override_repository=rules_cc="$root/bazel/offline/rules_cc" \
  --override_repository=rules_java="$root/bazel/offline/rules_java" \
  "$@"
