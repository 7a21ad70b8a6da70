"""argparse `type=` validators shared by `tigon bench` and `tigon demo`: a bad value is a usage
error (message and exit status 2), not a traceback."""

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def positive_int_list(text: str) -> str:
    """A comma-separated list of positive integers, e.g. "1,8"; returned as given (the commands split it)."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8, got {text!r}")
    for part in parts:
        try:
            positive_int(part)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8, got "
                                             f"{text!r}") from None
    return text


def name_list(text: str) -> str:
    """A non-empty comma-separated list of names, e.g. "rms_norm,swiglu"."""
    if not text.strip() or any(not part.strip() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"expected comma-separated names such as rms_norm,swiglu, got {text!r}")
    return text


def device(text: str) -> str:
    """cpu or cuda (the benchmarks compare the name), and a CUDA device must exist here."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return indexed_device(text)


def indexed_device(text: str) -> str:
    """cpu, cuda or cuda:N, and that CUDA device must exist here."""
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here (torch {torch.__version__})")
        if index and int(index) >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s)")
    return text
