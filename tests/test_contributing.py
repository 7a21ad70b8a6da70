"""CONTRIBUTING.md cannot drift from the code. Of what it names in backticks (and its relative links):
- every file path exists (`<op>` and `*` stand for any name), and every `path::name` is defined in that file;
- every dotted `tigon.`, `tests.` or `torch.` name imports or resolves;
- every bare identifier (`RMSNormFunction`, `_validate(op, ...)`) is a word of the Python code."""

import ast
import functools
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "CONTRIBUTING.md"

_SPAN = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line, as in Markdown
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"[\w.<>*-]+(?:/[\w.<>*-]*)+|[\w<>*-]+\.(?:py|md|json|sh|toml|txt|cfg)")
_NAME = re.compile(r"(?:tigon|tests|torch)(?:\.\w+)+")
_IDENT = re.compile(r"(\w*[A-Za-z]\w*)(?:\(.*)?", re.S)
_WORD = re.compile(r"\w+")


def references(text: str) -> tuple[set[str], set[str], set[str]]:
    """(file paths, dotted names, bare identifiers) that `text` names in backticks, plus its relative link
    targets. Paths and dotted names are read from each whitespace-separated word of a span (a command's file
    arguments count too); a call `f(...)` names f. Identifiers ending in "_" are prefixes (`o_`), not names."""
    paths, names, idents = set(), set(), set()
    for span in _SPAN.findall(text):
        if (m := _IDENT.fullmatch(span.strip())) and not m.group(1).endswith("_"):
            idents.add(m.group(1))
            continue
        for word in span.split():
            word = word.strip(",;:\"'").split("(")[0]
            if _NAME.fullmatch(word):
                names.add(word)
            elif _PATH.fullmatch(word.split("::")[0]) and not word.startswith(("-", "http")):
                paths.add(word)
    paths.update(t for t in _LINK.findall(text) if "://" not in t)
    return paths, names, idents


def _defines(path: Path, qualname: str) -> bool:
    """Whether the Python file defines `qualname` (a function, class or assigned name, or Class.method)."""
    body = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def missing_path(ref: str) -> str | None:
    """Why `ref` (a path relative to the repository root, optionally `::name`) does not exist, or None."""
    path, _, name = ref.partition("::")
    pattern = re.sub(r"<[^>]*>", "*", path.rstrip("/"))
    matches = sorted(ROOT.glob(pattern)) if "*" in pattern else [ROOT / pattern] if (ROOT / pattern).exists() else []
    if not matches:
        return f"{ref}: no such file or folder"
    name = name.split("[")[0]
    if name and not any(p.suffix == ".py" and _defines(p, name) for p in matches):
        return f"{ref}: {name} is not defined in {path}"
    return None


def missing_name(dotted: str) -> str | None:
    """Why `dotted` (a module, or a module's attribute chain) does not resolve, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            try:
                obj = getattr(obj, attr)
            except Exception as e:  # noqa: BLE001  (a lazy attribute may fail to import: also a broken name)
                return f"{dotted}: {'.'.join(parts[:i])}.{attr}: {type(e).__name__}: {e}"
        return None
    return f"{dotted}: no such module"


@functools.cache
def code_words() -> frozenset[str]:
    """Every word of the Python code (src, tests, benchmarks; this file left out) and of pyproject.toml."""
    files = [p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
             if p != Path(__file__).resolve()]
    return frozenset(w for p in [*files, ROOT / "pyproject.toml"] for w in _WORD.findall(p.read_text()))


def test_backticks_pair_up():
    """An unpaired backtick would shift every span after it, and the checks below would read prose as names."""
    assert GUIDE.read_text().count("`") % 2 == 0


def test_every_path_in_the_guide_exists():
    paths, _, _ = references(GUIDE.read_text())
    assert len(paths) >= 30, f"the guide's paths were not found: {sorted(paths)}"
    missing = [why for p in sorted(paths) if (why := missing_path(p))]
    assert not missing, missing


def test_every_dotted_name_in_the_guide_resolves():
    _, names, _ = references(GUIDE.read_text())
    assert len(names) >= 20, f"the guide's names were not found: {sorted(names)}"
    missing = [why for n in sorted(names) if (why := missing_name(n))]
    assert not missing, missing


def test_every_identifier_in_the_guide_is_in_the_code():
    _, _, idents = references(GUIDE.read_text())
    assert len(idents) >= 40, f"the guide's identifiers were not found: {sorted(idents)}"
    missing = sorted(idents - code_words())
    assert not missing, f"named in CONTRIBUTING.md, found nowhere in the code: {missing}"


def test_a_stale_reference_is_caught():
    text = ("`src/tigon/ops/rms_norm.py` `src/tigon/ops/no_such_op.py` `tests/_grid.py::assert_bound` "
            "`tests/_grid.py::no_such_bound` `docs/ops/<op>.md` `docs/no_such/<op>.md` "
            "`python -m pytest tests/no_such_test.py -q` [page](docs/no_such_page.md#part) [web](https://x.org/a/b) "
            "`tigon.ops._library.dispatch(op, fn)` `tigon.ops._library.no_such_rule` `tigon.no_such_module` "
            "`tests._grid.sum_ulps` `torch.library.custom_op` `torch.library.no_such_op` "
            "`RMSNormFunction` `_validate(op, ...)` `NoSuchFunction` `_no_such_launch(x)` `o_`")
    paths, names, idents = references(text)
    assert "https://x.org/a/b" not in paths and "o_" not in idents
    bad = ({p for p in paths if missing_path(p)} | {n for n in names if missing_name(n)}
           | (idents - code_words()))
    assert bad == {"src/tigon/ops/no_such_op.py", "tests/_grid.py::no_such_bound", "docs/no_such/<op>.md",
                   "tests/no_such_test.py", "docs/no_such_page.md", "tigon.ops._library.no_such_rule",
                   "tigon.no_such_module", "torch.library.no_such_op", "NoSuchFunction", "_no_such_launch"}
