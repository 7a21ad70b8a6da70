"""The project speaks of itself only: the code, tests, benchmarks and docs use no words of the tools it was built
with (the external reference-benchmark folder, work sessions, lent machines, their output folder and wheel
carrying). Each hit is named as file:line; a phrase broken across lines is found too."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("src", "tests", "benchmarks", "docs")
SCANNED_FILES = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")
SUFFIXES = (".py", ".md", ".sh")  # code and prose; the results JSON is measured data, left as written
THIS_FILE = Path(__file__).resolve()  # holds the patterns themselves

# name -> pattern (case-insensitive; a space matches any run of whitespace, line breaks included)
WORDS = {
    "anchors": r"\banchors?\b",
    "shared/": r"\bshared/\w",
    "session": r"\bsessions?\b",
    "the lead": r"\bthe lead\b",
    "carry=": r"\bcarry\s*=",
    "carried wheels": r"\bcarr(?:y|ies|ied)\b[^.]{0,20}\bwheels?\b",
    "device-wheels": r"\bdevice-wheels\b",
    "lent machine": r"\blent (?:GPU |H100 |H200 )?machines?\b",
    "device time": r"\bdevice time\b",
    "device call": r"\bdevice calls?\b",
    "$OUT": r"\$OUT\b|\b(?:env\w*(?:\.get)?|getenv)\(\s*['\"]OUT['\"]",  # os.environ.get("OUT") too
}
PATTERNS = {name: re.compile(p.replace(" ", r"\s+"), re.IGNORECASE) for name, p in WORDS.items()}

# (file, word) -> why that file's use is a technical one
ALLOWED = {
    ("tests/conftest.py", "session"): "pytest's test session",
    ("tests/test_cli.py", "$OUT"): "asserts that `tigon bench --help` does not mention it",
    ("tests/decode/test_bench_decode_args.py", "$OUT"): "asserts that bench_decode's --help does not mention it",
    ("benchmarks/profile_ttft.py", "device time"): "torch.profiler's time of the kernels on the GPU",
    ("benchmarks/prefill_host.py", "device time"): "the GPU time of the profiled kernels",
}


def scanned_files(root: Path = ROOT):
    for name in SCANNED_FILES:
        if (root / name).is_file():
            yield root / name
    for d in SCANNED_DIRS:
        for path in sorted((root / d).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path


def hits(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: word: the line' for each word of WORDS in path that ALLOWED does not excuse."""
    rel = path.relative_to(root).as_posix()
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    found = []
    for name, pattern in PATTERNS.items():
        if (rel, name) in ALLOWED:
            continue
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{rel}:{line}: {name}: {lines[line - 1].strip()[:120]}")
    return found


def test_the_project_speaks_of_itself_only():
    found = [h for path in scanned_files() if path.resolve() != THIS_FILE for h in hits(path)]
    assert not found, "words of the tools the project was built with:\n" + "\n".join(sorted(found))


def test_the_scan_names_file_and_line_and_spares_technical_words(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "note.md").write_text(
        "Timed as the anchors' timer does, in shared memory,\nthen run with carry=[\".whl\"] by the\n"
        "lead in this session; output in $OUT, never silently.\n")
    (tmp_path / "docs" / "tool.py").write_text(
        "p = subprocess.Popen(cmd, start_new_session=True)  # the leading dims\nout = os.environ.get('OUT', '.')\n")

    def found():
        return sorted(tuple(h.split(": ")[:2]) for path in scanned_files(tmp_path) for h in hits(path, tmp_path))

    assert found() == [("docs/note.md:1", "anchors"), ("docs/note.md:2", "carry="), ("docs/note.md:2", "the lead"),
                       ("docs/note.md:3", "$OUT"), ("docs/note.md:3", "session"), ("docs/tool.py:2", "$OUT")]
    monkeypatch.setitem(ALLOWED, ("docs/note.md", "anchors"), "a file that explains the word")
    assert ("docs/note.md:1", "anchors") not in found()
