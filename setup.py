"""Builds ud_transport._native (the engine, UDP / in-memory / loss-injection transports, the
simulator; no RDMA library) and, where the libibverbs headers are found, the optional RDMA
extension ud_transport._verbs (verbs bindings and the verbs UD transport, linking libibverbs).

UD_BUILD_VERBS=0 skips _verbs; UD_BUILD_VERBS=1 makes missing headers an error; unset, _verbs
is built when <infiniband/verbs.h> is found and skipped with one line saying so otherwise."""
import glob
import os
import sys

from setuptools import Extension, setup

VERBS_HEADER = "infiniband/verbs.h"
# The only C files that include <infiniband/verbs.h>; everything else is the engine, which
# must be compiled into _native alone (a C file in both extensions is code twice at run time).
VERBS_SOURCES = ["native/transport_verbs.c", "native/verbs_probe.c"]
ENGINE_SOURCES = sorted(set(glob.glob("native/*.c")) - set(VERBS_SOURCES))
COMPILE_ARGS = ["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"]
INSTALL_HINT = "install libibverbs-dev (Debian/Ubuntu) or rdma-core-devel (Fedora/RHEL)"


def verbs_header_found():
    include_dirs = ["/usr/include", "/usr/local/include"] + os.environ.get("CPATH", "").split(":")
    return any(d and os.path.exists(os.path.join(d, VERBS_HEADER)) for d in include_dirs)


def build_verbs():
    """Whether to build _verbs; says why not, or stops the build when UD_BUILD_VERBS=1 cannot be met."""
    wanted = os.environ.get("UD_BUILD_VERBS", "")
    if wanted not in ("", "0", "1"):
        sys.exit(f"ud_transport: UD_BUILD_VERBS must be 0, 1 or unset, not {wanted!r}")
    if wanted == "0":
        print("ud_transport: skipping the RDMA extension ud_transport._verbs (UD_BUILD_VERBS=0); "
              "UDP only", file=sys.stderr)
        return False
    if verbs_header_found():
        return True
    if wanted == "1":
        sys.exit(f"ud_transport: UD_BUILD_VERBS=1 but <{VERBS_HEADER}> is not found; {INSTALL_HINT}")
    print(f"ud_transport: skipping the RDMA extension ud_transport._verbs (<{VERBS_HEADER}> not found; "
          f"{INSTALL_HINT} for RDMA); UDP only", file=sys.stderr)
    return False


extensions = [Extension(
    "ud_transport._native",
    sources=["cython/_native.pyx"] + ENGINE_SOURCES,
    include_dirs=["native", "cython"],
    extra_compile_args=COMPILE_ARGS,
)]
if build_verbs():
    extensions.append(Extension(
        "ud_transport._verbs",
        sources=["cython/_verbs.pyx"] + VERBS_SOURCES,
        include_dirs=["native", "cython"],
        libraries=["ibverbs"],
        extra_compile_args=COMPILE_ARGS,
    ))

setup(ext_modules=extensions)
