"""The results pages' rendered tables equal what benchmarks/tools/render_table.py renders from the committed JSON, and
the check names a table that drifted."""

from pathlib import Path

import pytest

from benchmarks.tools import render_table

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "benchmarks" / "results" / "h200.md", ROOT / "docs" / "generation.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_rendered_table_equals_its_json(page):
    text = page.read_text()
    assert "<!-- rendered:" in text
    assert render_table.drifted(text, render_table.RESULTS) == []


def test_every_topic_is_on_the_results_page():
    blocks = {m.group(2): m.group(3) for m in render_table.BLOCK.finditer(PAGES[0].read_text())}
    assert set(blocks) == set(render_table.TOPICS)
    assert all("Measured by:" in b and "|---|" in b for b in blocks.values())


def test_a_changed_number_is_named_and_write_restores_it(tmp_path, capsys):
    page = tmp_path / "page.md"
    good = PAGES[0].read_text()
    page.write_text(good.replace("| 740.7 |", "| 700.0 |", 1))
    assert render_table.main(["--check", str(page)]) == 1
    assert "the 'lora' table differs" in capsys.readouterr().err
    assert render_table.main(["--write", str(page)]) == 0
    assert page.read_text() == good and render_table.main(["--check", str(page)]) == 0


def test_an_unknown_topic_is_refused():
    with pytest.raises(ValueError, match="render_page: unknown topic 'nope'"):
        render_table.render_page("<!-- rendered: nope -->\n<!-- end rendered -->", render_table.RESULTS)


def test_a_missing_page_exits_2(tmp_path, capsys):
    assert render_table.main(["--check", str(tmp_path / "absent.md")]) == 2
    assert "cannot read" in capsys.readouterr().err
