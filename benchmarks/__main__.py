"""`python -m benchmarks NAME [args]`: run one benchmark (its own options follow NAME; `NAME --help` lists them).
`python -m benchmarks --list`: every NAME with its module and what it measures."""

import sys

from benchmarks import BY_NAME, load, summary

USAGE = "usage: python -m benchmarks NAME [args]   |   python -m benchmarks --list"


def listing() -> str:
    """One line per benchmark: NAME, module, the first line of its docstring."""
    width = max(map(len, BY_NAME))
    mod_width = max(map(len, BY_NAME.values()))
    return "\n".join(f"{name:<{width}}  {module:<{mod_width}}  {summary(module)}" for name, module in BY_NAME.items())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}\n\n{listing()}")
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BY_NAME:
        print(f"{USAGE}\npython -m benchmarks: unknown benchmark {name!r}; `python -m benchmarks --list` names them",
              file=sys.stderr)
        return 2
    # The benchmark's own parser reads sys.argv as a script's would: its usage line names this command, and what it
    # records of its command line (gpu_check's argv) is the benchmark's options alone, as when it ran as a file.
    sys.argv = [f"python -m benchmarks {name}", *rest]
    rc = load(name).main(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
