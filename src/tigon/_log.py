"""The "tigon" logger and the TIGON_LOG environment variable.

    TIGON_LOG=info python train.py     # patch reports, what each Liger-style call applied or left alone
    TIGON_LOG=debug python train.py    # and the per-call details

Without TIGON_LOG, Tigon adds no handler: its records go where the application's logging sends them (Python's
default shows WARNING and above on stderr). With it, the "tigon" logger gets one stderr handler at that level.
The variable is read once, when `get_logger()` first runs (the first patch, apply or kernel-config call), never
at import and never written.
"""

import logging
import os
import sys
import warnings

NAME = "tigon"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Handler(logging.StreamHandler):
    """Marks the handler as Tigon's, so configuring twice never adds a second one. Writes to the sys.stderr of
    the moment (a test's capture, a notebook's redirect), not the one at configure time."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(_FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property above always reads sys.stderr
        pass


def level_from_env(environ=None):
    """The level TIGON_LOG names (debug, info, warning, error; any case), or None when it is unset or empty.
    An unknown value warns and counts as unset."""
    value = (os.environ if environ is None else environ).get("TIGON_LOG", "").strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        warnings.warn(f"TIGON_LOG={value!r} is not one of {', '.join(LEVELS)}; Tigon adds no log handler",
                      stacklevel=3)
        return None
    return LEVELS[value]


def get_logger() -> logging.Logger:
    """The "tigon" logger, configured from TIGON_LOG on the first call of the process."""
    logger = logging.getLogger(NAME)
    if not logger.__dict__.get("_tigon_configured"):
        logger._tigon_configured = True
        level = level_from_env()
        if level is not None and not any(isinstance(h, _Handler) for h in logger.handlers):
            handler = _Handler()
            handler.setLevel(level)
            logger.addHandler(handler)
            logger.setLevel(level)
    return logger
