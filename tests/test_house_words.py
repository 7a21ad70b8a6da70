"""The project speaks of itself only: the code, tests, benchmarks and docs use no words of the tools it was built
with (an external reference-benchmark folder, the working periods, the borrowed GPU machines, their output folder
and how wheels reached them). Each hit is named as file:line; a phrase broken across lines is found too. The words
are spelled here through `_w` ("anch|ors" is the word without the bar) so that this file holds none of them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("src", "tests", "benchmarks", "docs")
SCANNED_FILES = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")
SUFFIXES = (".py", ".md", ".sh")  # code and prose; the results JSON is measured data, left as written
THIS_FILE = Path(__file__).resolve()  # holds the patterns themselves

# name -> pattern (case-insensitive; a space matches any run of whitespace, line breaks included)
def _w(text: str) -> str:
    return text.replace("|", "")


WORDS = {
    _w("anch|ors"): _w(r"\banch|ors?\b"),
    "shared/": r"\bshared/\w",
    _w("sess|ion"): _w(r"\bsess|ions?\b"),
    _w("the le|ad"): _w(r"\bthe le|ad\b"),
    _w("car|ry="): _w(r"\bcar|ry\s*="),
    _w("car|ried wheels"): _w(r"\bcar|r(?:y|ies|ied)\b[^.]{0,20}\bwheels?\b"),
    _w("device-wh|eels"): _w(r"\bdevice-wh|eels\b"),
    _w("le|nt machine"): _w(r"\ble|nt (?:GPU |H100 |H200 )?machines?\b"),
    _w("device ti|me"): _w(r"\bdevice ti|me\b"),
    _w("device ca|ll"): _w(r"\bdevice ca|lls?\b"),
    "$OUT": r"\$OUT\b|\b(?:env\w*(?:\.get)?|getenv)\(\s*['\"]OUT['\"]",  # os.environ.get("OUT") too
}
PATTERNS = {name: re.compile(p.replace(" ", r"\s+"), re.IGNORECASE) for name, p in WORDS.items()}

# (file, word) -> why that file's use is a technical one
ALLOWED = {
    ("tests/conftest.py", _w("sess|ion")): _w("pytest's test sess|ion"),
    ("tests/test_cli.py", "$OUT"): "asserts that `tigon bench --help` does not mention it",
    ("tests/benchmarks/test_decode_args.py", "$OUT"): "asserts that bench_decode's --help does not mention it",
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
        _w("Timed as the anch|ors' timer does, in shared memory,\nthen run with car|ry=[\".whl\"] by the\n"
           "le|ad in this sess|ion; output in $OUT, never silently.\n"))
    (tmp_path / "docs" / "tool.py").write_text(
        "p = subprocess.Popen(cmd, start_new_session=True)  # the leading dims\nout = os.environ.get('OUT', '.')\n")

    def found():
        return sorted(tuple(h.split(": ")[:2]) for path in scanned_files(tmp_path) for h in hits(path, tmp_path))

    assert found() == [("docs/note.md:1", _w("anch|ors")), ("docs/note.md:2", _w("car|ry=")),
                       ("docs/note.md:2", _w("the le|ad")), ("docs/note.md:3", "$OUT"),
                       ("docs/note.md:3", _w("sess|ion")), ("docs/tool.py:2", "$OUT")]
    monkeypatch.setitem(ALLOWED, ("docs/note.md", _w("anch|ors")), "a file that explains the word")
    assert ("docs/note.md:1", _w("anch|ors")) not in found()
