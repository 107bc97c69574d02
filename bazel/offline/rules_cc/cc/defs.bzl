"""An offline stand-in for @rules_cc//cc:defs.bzl: Bazel's native C++ rules under their names.

Bazel 4's own @bazel_tools//tools/cpp:BUILD loads @rules_cc//cc:defs.bzl, and Bazel's default
WORKSPACE suffix declares @rules_cc as an http_archive (rules_cc commit b1c40e1de819, from
mirror.bazel.build or github.com). Debian's bazel-bootstrap package has no copy of that archive
(no distdir, no repository cache), so on a host without network access every C++ build fails
while resolving the C++ toolchain with "no such package '@rules_cc//cc': ... Unknown host".

This file offers the same symbols as that rules_cc's cc/defs.bzl, where they are thin
macros over the native rules as well. It is opt-in, for offline builds only:
bazel/offline_bazel.sh passes --override_repository=rules_cc=<this directory>.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
