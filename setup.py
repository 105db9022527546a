"""Builds the one compiled extension, ud_transport._native, from cython/ and native/."""
import glob
import os
import sys

from setuptools import Extension, setup

VERBS_HEADER = "infiniband/verbs.h"


def require_verbs_header():
    include_dirs = ["/usr/include", "/usr/local/include"] + os.environ.get("CPATH", "").split(":")
    if not any(d and os.path.exists(os.path.join(d, VERBS_HEADER)) for d in include_dirs):
        sys.exit(
            "ud_transport: cannot find <infiniband/verbs.h>. Install the libibverbs headers first:\n"
            "    Debian/Ubuntu: apt-get install libibverbs-dev\n"
            "    Fedora/RHEL:   dnf install rdma-core-devel"
        )


require_verbs_header()

extension = Extension(
    "ud_transport._native",
    sources=["cython/_native.pyx"] + sorted(glob.glob("native/*.c")),
    include_dirs=["native", "cython"],
    libraries=["ibverbs"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)

setup(ext_modules=[extension])
