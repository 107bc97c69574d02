"""An offline stand-in for @rules_java//java:defs.bzl: Bazel's native Java rules under their names.

Nothing in ftjax is Java, but Bazel 4's default WORKSPACE suffix registers the toolchains
@bazel_tools//tools/jdk:all, and resolving any toolchain (the C++ one included) parses that
package, whose BUILD file loads @rules_java//java:defs.bzl. @rules_java is declared as an
http_archive (rules_java commit 7cf3cefd6520) that Debian's bazel-bootstrap has no copy of,
so offline the C++ build fails with "no such package '@rules_java//java'". Opt-in, for
offline builds only: bazel/offline_bazel.sh passes --override_repository=rules_java=<this
directory>.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_lite_proto_library(**attrs):
    native.java_lite_proto_library(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
