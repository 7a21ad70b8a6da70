"""benchmarks/run_gpu.sh: the steps its header lists are the steps its case statement runs, each documented, and the
script parses (bash -n). The runs themselves need a GPU."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "run_gpu.sh"


def _listed(text: str) -> set[str]:
    """The names after 'steps:' in the header's usage lines (up to the first blank comment line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "steps:" in line)
    names = lines[start].split("steps:", 1)[1].split()
    for line in lines[start + 1:]:
        body = line.lstrip("#").strip()
        if not body:
            break
        names += body.split()
    return set(names)


def _branches(text: str) -> set[str]:
    labels = re.findall(r"^        ([a-z0-9|-]+)\)", text, flags=re.M)
    return {name for label in labels for name in label.split("|")}


def test_every_listed_step_runs_and_is_documented():
    text = SCRIPT.read_text()
    listed, branches = _listed(text), _branches(text)
    assert listed == branches, (sorted(listed - branches), sorted(branches - listed))
    header = text.split("set -uo pipefail", 1)[0]
    undocumented = [s for s in listed if not re.search(rf"^#   (\S+ )*{re.escape(s)}( |$)", header, flags=re.M)]
    assert not undocumented, undocumented


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
