"""The "tigon" logger, the TIGON_LOG environment variable, and the message for a missing optional package.

    TIGON_LOG=info python train.py     # patch reports, what each Liger-style call applied or left alone
    TIGON_LOG=debug python train.py    # and the per-call details

Without TIGON_LOG, Tigon adds no handler: its records go where the application's logging sends them (Python's
default shows WARNING and above on stderr). With it, the "tigon" logger gets that level and one stderr handler,
which stays silent for a record a handler of the application (logging.basicConfig, ...) already shows, so every
line appears once. The variable is read once, when `get_logger()` first runs (the first patch, apply or
kernel-config call), never at import and never written.
"""

import contextlib
import importlib
import logging
import os
import sys
import warnings

NAME = "tigon"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# optional package (top-level import name) -> pyproject.toml's extra that installs it
EXTRAS = {"transformers": "hf", "accelerate": "hf", "peft": "hf", "trl": "trl", "kernels": "kernels",
          "liger_kernel": "bench", "cut_cross_entropy": "bench", "matplotlib": "bench",
          "prometheus_client": "metrics"}
# required by Tigon itself, but installed apart when a CUDA build is wanted
PACKAGES = {"torch": "pip install torch (https://pytorch.org/get-started for a CUDA build)",
            "triton": "pip install triton"}


def _shown_by_application(record: logging.LogRecord) -> bool:
    """Whether a handler above the "tigon" logger (the application's) will emit this record."""
    logger = logging.getLogger(NAME)
    while logger.propagate and logger.parent is not None:
        logger = logger.parent
        if any(record.levelno >= h.level for h in logger.handlers):
            return True
    return False


class _Handler(logging.StreamHandler):
    """Marks the handler as Tigon's, so configuring twice never adds a second one. Writes to the sys.stderr of
    the moment (a test's capture, a notebook's redirect), not the one at configure time, and leaves a record
    the application's own handlers show to them (checked per record: logging may be configured later)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(_FORMAT))
        self.addFilter(lambda record: not _shown_by_application(record))

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


def _shown(logger: logging.Logger, level: int) -> bool:
    """Whether a record of `level` from `logger` reaches a handler that emits it (Python's last-resort handler,
    which shows WARNING and above only when no handler exists, does not count)."""
    if not logger.isEnabledFor(level):
        return False
    while logger is not None:
        if any(level >= h.level for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def report(message: str, verbose: bool = False) -> None:
    """Log `message` at INFO; with verbose=True make sure it is seen once: logged where the logging setup shows
    INFO records of "tigon" (TIGON_LOG=info, or the application's config), printed on stdout otherwise."""
    logger = get_logger()
    if verbose and not _shown(logger, logging.INFO):
        print(message)
    else:
        logger.info("%s", message)


def missing_package(error: ModuleNotFoundError, what: str):
    """The ModuleNotFoundError to raise instead of `error` when `what` (e.g. "tigon.patch") needs an optional
    package that is not installed: its message names the package and the pip command (the extra of
    pyproject.toml). None when `error` is about some other module (a bug to let through as it is)."""
    top = (error.name or "").partition(".")[0]
    if top in EXTRAS:
        install = f'pip install "tigon[{EXTRAS[top]}]"'
    elif top in PACKAGES:
        install = PACKAGES[top]
    else:
        return None
    return ModuleNotFoundError(f"{what} needs the {top!r} package, which is not installed: {install}",
                               name=error.name)


@contextlib.contextmanager
def requires_extra(what: str):
    """Turn a ModuleNotFoundError of an optional package, raised inside the block, into one that says which
    extra to install (`missing_package`); any other error passes unchanged.

        with _log.requires_extra("tigon.decode.metrics"):
            import prometheus_client
    """
    try:
        yield
    except ModuleNotFoundError as e:
        clear = missing_package(e, what)
        if clear is None:
            raise
        raise clear from e


def import_optional(module: str, what: str):
    """importlib.import_module(module), with the message of `requires_extra` when a package is missing."""
    with requires_extra(what):
        return importlib.import_module(module)
