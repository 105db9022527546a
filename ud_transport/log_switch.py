"""UD_LOG: the one switch that turns up the library's logging. The library logs through `logging`
only, to the "ud_transport" logger, silent by default (a NullHandler); UD_LOG=debug|info|warning|error
adds one stderr handler at that level, each line naming the rank when RANK is set."""
import logging
import os
import sys
import warnings

from . import environment

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def apply_environment(logger, environ=os.environ):
    """Returns the handler UD_LOG added, or None (unset, or a value that is not a level: warned)."""
    value = environment.read("UD_LOG", "", environ).strip().lower()
    if not value:
        return None
    level = LEVELS.get(value)
    if level is None:
        warnings.warn(f"UD_LOG={value!r} is not one of {', '.join(LEVELS)}; logging left as it was", stacklevel=2)
        return None
    handler = logging.StreamHandler(sys.stderr)
    rank = environ.get("RANK")
    handler.setFormatter(logging.Formatter(f"ud_transport{f'[rank {rank}]' if rank else ''} %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
