"""The per-user table cache: rows `tigon tune` measured on this machine's GPU, read before the shipped tables.

Tigon's shipped tables (hf/attention_table.py's MEASURED, the MEASURED_PICKS of ops/decode_linear_picks.py and
ops/quant_linear_picks.py) hold what was measured on the GPUs its authors timed. `tigon tune` times the current card
and writes its own rows to one JSON file, `$TIGON_CACHE_DIR/tuned.json` (default `~/.cache/tigon/tuned.json`), as
Triton keeps its autotuning results; the attention ranking and the decode_linear and quant_linear picks read it first
(`for_gpu`), then the shipped rows, then the rule.

An entry is keyed by the GPU name (torch.cuda.get_device_name), the torch version and the Triton version: a new
torch or Triton may change which kernel is fastest, so an entry of other versions is not read (`tigon env` says so,
and `tigon tune` again measures for the new ones). The file is read once per process, on the first lookup outside
torch.compile tracing (a lookup while dynamo traces, before any eager one, sees no cache and touches no file), and
kept: no file I/O per call. A file that cannot be read or parsed, or of another format, is ignored with one warning
and the shipped tables apply: the cache only ever chooses among exact kernels, so a bad one costs speed, never
correctness. `write` replaces the file atomically (a temporary file renamed over it), so a reader never sees half.

    {"format": 1, "entries": [{"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu128", "triton": "3.6.0",
      "attention": {"packed": ["flex", "varlen"], "causal": []},
      "decode_linear": [{"key": [4096, 6144, 1, "norm"], "config": [64, 256, 4, 4, 2, 0]}],
      "quant_linear": [{"key": [4096, 4096, 1, "int4", 128, false], "config": [0, 128, 512, 4, 0, 4, -1, 1, -1]}],
      ...}]}

`attention[kind]`: the backends faster than Hugging Face's pick on this card, fastest first (empty: none was).
`decode_linear`: (K, N, batch bucket, kind) -> `DecodeLinearConfig.ints()`, as decode_linear_picks keys them.
`quant_linear` (optional: a file without it reads as no picks): (K, N, rows bucket, fmt, group_size, glu) ->
`QuantLinearConfig.ints()`, as quant_linear_picks keys them.
"""

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from . import _library
from .config import DecodeLinearConfig, QuantLinearConfig

FORMAT = 1
FILE_NAME = "tuned.json"


class TunedRows(NamedTuple):
    """The rows of one GPU (this process's torch and Triton) in the cache file at `path`."""

    path: str
    attention: dict  # mask kind -> tuple of backend names, fastest first (empty: HF's pick measured fastest)
    decode_linear: dict  # (K, N, batch bucket, kind) -> config ints tuple
    quant_linear: dict  # (K, N, rows bucket, fmt, group_size, glu) -> QuantLinearConfig ints tuple


class CacheState(NamedTuple):
    """What one read of the cache file found: `rows` per GPU for this torch and Triton, `others` (gpu, torch,
    triton) of the entries kept for other versions, `problem` why the file was ignored (None: it was not)."""

    path: str
    rows: dict
    others: tuple
    problem: str | None


_STATE: CacheState | None = None  # the file as read, once per process (reset() forgets it)


def cache_path(environ=None) -> Path:
    """The cache file: $TIGON_CACHE_DIR/tuned.json, else ~/.cache/tigon/tuned.json."""
    where = (os.environ if environ is None else environ).get("TIGON_CACHE_DIR", "")
    return Path(where) / FILE_NAME if where else Path(os.path.expanduser("~")) / ".cache" / "tigon" / FILE_NAME


def versions() -> tuple[str, str | None]:
    """(torch version, Triton version or None): the part of an entry's key besides the GPU name."""
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = None
    return str(torch.__version__), triton_version


def _config(value, where: str) -> tuple:
    if not isinstance(value, list) or not 5 <= len(value) <= 6 or not all(type(v) is int for v in value):
        raise ValueError(f"{where}: config must be a list of 5 or 6 ints, got {value!r}")
    DecodeLinearConfig(*value)  # its own checks (powers of two, block_k >= 16): a ValueError names the field
    return tuple(value)


def _key(value, where: str) -> tuple:
    if (not isinstance(value, list) or len(value) != 4 or not all(type(v) is int and v > 0 for v in value[:3])
            or not isinstance(value[3], str)):
        raise ValueError(f"{where}: key must be [K, N, batch bucket, kind], got {value!r}")
    return tuple(value)


def _quant_config(value, where: str) -> tuple:
    """A QuantLinearConfig.ints() list: 10 ints, or 9 (the fields before `code_mma`, which then reads -1)."""
    if not isinstance(value, list) or len(value) not in (9, 10) or not all(type(v) is int for v in value):
        raise ValueError(f"{where}: config must be a list of 10 ints (QuantLinearConfig.ints()), got {value!r}")
    QuantLinearConfig(*value)  # its own checks (powers of two, >= 16, -1 defaults): a ValueError names the field
    return tuple(value)


def _quant_key(value, where: str) -> tuple:
    if (not isinstance(value, list) or len(value) != 6 or not all(type(v) is int and v > 0 for v in value[:3])
            or not isinstance(value[3], str) or type(value[4]) is not int or value[4] < 0
            or not isinstance(value[5], bool)):
        raise ValueError(f"{where}: key must be [K, N, rows bucket, format, group size, glu], got {value!r}")
    return tuple(value)


def _picks(raw, section: str, where: str, key, config) -> dict:
    picks = raw.get(section, [])
    if not isinstance(picks, list) or not all(isinstance(p, dict) for p in picks):
        raise ValueError(f"{where}.{section} must be a list of {{key, config}} objects")
    return {key(p.get("key"), f"{where}.{section}[{j}]"): config(p.get("config"), f"{where}.{section}[{j}]")
            for j, p in enumerate(picks)}


SECTIONS = ("gpu", "torch", "triton", "attention", "decode_linear", "quant_linear")


def _entry(raw, i: int) -> dict:
    """One entry of the file, checked: gpu / torch / triton strings, attention {kind: [backend, ...]},
    decode_linear and quant_linear [{key, config}]. Raises ValueError naming what is wrong."""
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
    for field in ("gpu", "torch", "triton"):
        if not (isinstance(raw.get(field), str) or (field == "triton" and raw.get(field) is None)):
            raise ValueError(f"{where}.{field} must be a string, got {raw.get(field)!r}")
    attention = raw.get("attention", {})
    if not isinstance(attention, dict) or not all(
            isinstance(rows, list) and all(isinstance(b, str) for b in rows) for rows in attention.values()):
        raise ValueError(f"{where}.attention must map mask kinds to lists of backend names")
    decode = _picks(raw, "decode_linear", where, _key, _config)
    quant = _picks(raw, "quant_linear", where, _quant_key, _quant_config)
    extra = {k: v for k, v in raw.items() if k not in SECTIONS}
    return dict(gpu=raw["gpu"], torch=raw["torch"], triton=raw["triton"],
                attention={kind: tuple(rows) for kind, rows in attention.items()}, decode_linear=decode,
                quant_linear=quant, **extra)


def parse(data) -> list[dict]:
    """The entries of a decoded cache file (json.loads of it), checked; ValueError says what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"the file holds a {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}; this Tigon reads format {FORMAT}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError("no 'entries' list")
    return [_entry(raw, i) for i, raw in enumerate(entries)]


def read(path) -> tuple[list[dict], str | None]:
    """(entries, None) of the file at `path`, ([], None) where there is none, ([], why) where it is unreadable."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return [], None
    except (OSError, UnicodeDecodeError) as e:
        return [], f"cannot read it ({type(e).__name__}: {e})"
    try:
        return parse(json.loads(text)), None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return [], f"{type(e).__name__}: {e}"


def load(path=None) -> CacheState:
    """Read the cache file (default: cache_path()) and keep what it holds for the rest of the process; a file
    that cannot be used warns once, here, and counts as empty."""
    global _STATE
    path = Path(path) if path is not None else cache_path()
    entries, problem = read(path)
    if problem:
        warnings.warn(f"tigon: ignoring the tuned-table cache {path} ({problem}); the shipped tables apply. "
                      "`tigon tune` writes a new one.", RuntimeWarning, stacklevel=2)
    mine = versions()
    rows, others = {}, []
    for e in entries:
        if (e["torch"], e["triton"]) == mine:
            rows[e["gpu"]] = TunedRows(str(path), e["attention"], e["decode_linear"], e["quant_linear"])
        else:
            others.append((e["gpu"], e["torch"], e["triton"]))
    _STATE = CacheState(str(path), rows, tuple(others), problem)
    return _STATE


def state() -> CacheState:
    """The cache as this process read it (reading it now if it has not yet)."""
    return _STATE if _STATE is not None else load()


def for_gpu(gpu: str | None) -> TunedRows | None:
    """The cached rows of `gpu` (torch.cuda.get_device_name; None: no GPU) for this torch and Triton, or None.
    Cheap: dictionary lookups once the file was read. While torch.compile traces, a file not yet read is not
    read (no file I/O in a traced graph): the rows the first eager lookup (tigon.patch makes one) loaded apply."""
    if not gpu:
        return None
    current = _STATE
    if current is None:
        if _library.tracing():
            return None
        current = load()
    return current.rows.get(gpu)


def reset() -> None:
    """Forget what was read: the next lookup reads the file again (after `write`, or a test's TIGON_CACHE_DIR)."""
    global _STATE
    _STATE = None


def _as_json(entry: dict) -> dict:
    out = {k: v for k, v in entry.items() if k not in ("attention", "decode_linear", "quant_linear")}
    out["attention"] = {kind: list(rows) for kind, rows in sorted(entry["attention"].items())}
    for section in ("decode_linear", "quant_linear"):
        if entry[section] or section == "decode_linear":  # no empty quant_linear list: the file as before
            out[section] = [dict(key=list(key), config=list(cfg)) for key, cfg in sorted(entry[section].items())]
    return out


def write(gpu: str, *, attention: dict | None = None, decode_linear: dict | None = None,
          quant_linear: dict | None = None, path=None, info: dict | None = None) -> Path:
    """Merge rows measured on `gpu` into the cache file (default cache_path()) and replace it atomically.

    attention {mask kind: backends, fastest first} replaces those kinds' rows; decode_linear {(K, N, bucket,
    kind): config ints} and quant_linear {(K, N, rows bucket, fmt, group_size, glu): config ints} add or replace
    those keys; the entry's other rows and the other entries stay. `info`
    (strings: when, which Tigon) is stored beside the rows. A file that cannot be read is replaced (with a
    warning). Returns the path written; the next lookup of this process reads it."""
    if not isinstance(gpu, str) or not gpu:
        raise ValueError(f"tigon.ops.tuned_cache.write: gpu must be a GPU name (a non-empty str), got {gpu!r}")
    path = Path(path) if path is not None else cache_path()
    entries, problem = read(path)
    if problem:
        warnings.warn(f"tigon: the tuned-table cache {path} could not be read ({problem}); writing a new one",
                      RuntimeWarning, stacklevel=2)
    torch_version, triton_version = versions()
    entry = next((e for e in entries if (e["gpu"], e["torch"], e["triton"]) == (gpu, torch_version, triton_version)),
                 None)
    if entry is None:
        entry = dict(gpu=gpu, torch=torch_version, triton=triton_version, attention={}, decode_linear={},
                     quant_linear={})
        entries.append(entry)
    entry.update({k: v for k, v in (info or {}).items() if k not in SECTIONS})
    entry["attention"].update({kind: tuple(rows) for kind, rows in (attention or {}).items()})
    entry["decode_linear"].update({tuple(key): tuple(cfg) for key, cfg in (decode_linear or {}).items()})
    entry["quant_linear"].update({tuple(key): tuple(cfg) for key, cfg in (quant_linear or {}).items()})
    text = json.dumps(dict(format=FORMAT, entries=[_as_json(e) for e in entries]), indent=1)
    parse(json.loads(text))  # never write a file this reader would refuse
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{FILE_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    reset()
    return path


def pick(section: str, gpu: str, key: tuple, shipped: dict, table: dict | None = None) -> tuple | None:
    """A measured launch for `key` on `gpu`, for the picks modules (ops/decode_linear_picks.py,
    ops/quant_linear_picks.py): the user cache's `section` rows first, then `shipped` ({gpu: {key: config}});
    `table` given: that table alone. None where nothing was measured."""
    if table is None:
        tuned = for_gpu(gpu)
        if tuned is not None and key in getattr(tuned, section):
            return getattr(tuned, section)[key]
        table = shipped
    return table.get(gpu, {}).get(key)


def picks_source(section: str, gpu: str | None, shipped: dict, rule: str, module: str, flag: str,
                 past_picks: str = "") -> str:
    """Where an op's launches come from on `gpu`, in words (for `tigon env`): the user cache's `section` rows, the
    shipped table of `module`, else `rule`; `flag` the `tigon tune` option that measures them, `past_picks` what
    takes the rule even where picks exist."""
    count = len(shipped.get(gpu, {})) if gpu else 0
    tuned = for_gpu(gpu)
    parts = []
    if tuned is not None and getattr(tuned, section):
        parts.append(f"user cache ({tuned.path}: {len(getattr(tuned, section))} shapes)")
    if count:
        parts.append(f"shipped table ({gpu} row: measured picks for {gpu}, {count} shapes, {module})")
    if parts:
        return ", then ".join(parts) + f", else {rule}" + (f"; {past_picks}: the rule" if past_picks else "")
    if not gpu:
        return f"rule (no GPU here; on one: {rule} wherever no pick was measured)"
    return f"rule (unmeasured card: {rule}; no measured picks for {gpu}; `tigon tune {flag}` measures this card's)"
