"""The optional RDMA extension ud_transport._verbs, imported on first use.

It is built only where the libibverbs headers were present (setup.py) and links
libibverbs.so.1, so importing it can fail on machines that only want UDP. Nothing
imports it at package import time: transports.py and lab/info.py ask here when the
verbs transport is requested or probed, and get either the module or why not."""
from importlib import import_module

_MODULE = "ud_transport._verbs"
_loaded = None
_problem = None


def load():
    """The _verbs module, or None when it cannot be imported (see problem())."""
    global _loaded, _problem
    if _loaded is None and _problem is None:
        try:
            _loaded = import_module(_MODULE)
        except ImportError as error:
            _problem = describe_import_error(error)
    return _loaded


def problem():
    """Why the verbs transport cannot be used at all ("" when the extension loads)."""
    load()
    return _problem or ""


def describe_import_error(error):
    if isinstance(error, ModuleNotFoundError) and error.name == _MODULE:
        return (f"the RDMA extension {_MODULE} was not built: <infiniband/verbs.h> was missing when "
                "ud_transport was built (or UD_BUILD_VERBS=0); install libibverbs-dev (Debian/Ubuntu) "
                "or rdma-core-devel (Fedora/RHEL) and reinstall ud_transport")
    return f"the RDMA extension {_MODULE} cannot be loaded (is libibverbs.so.1 installed?): {error}"
