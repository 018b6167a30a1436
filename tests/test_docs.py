"""The documentation's own consistency: docs/checks.md is the page the registry generates (a fix is
written once, in its check's docstring), every relative link of the pages leads somewhere, and the
CI recipe is YAML. The pages' examples run in tests/test_readme.py."""

import re

import pytest

from helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Pages linked before they exist: another change of issue 30 writes them (the environment variables,
# declared once). An entry goes once its page is there; the test says so.
PENDING: set[str] = set()  # pages linked before they are written


def test_the_check_catalogue_page_is_the_generated_one():
    from tfdoctor.registry import all_checks
    from tfdoctor.report.catalogue_markdown import PAGE, render_markdown

    assert PAGE == ROOT / "docs" / "checks.md"
    assert PAGE.read_text(encoding="utf-8") == render_markdown(all_checks()), \
        "docs/checks.md is stale: run python -m tfdoctor.report.catalogue_markdown"


def test_every_check_has_its_section_with_its_fix_written_once():
    from tfdoctor.registry import all_checks

    page = (ROOT / "docs" / "checks.md").read_text(encoding="utf-8")
    for spec in all_checks():
        assert spec.fix, f"{spec.id}: its docstring has no 'Fix:' paragraph"
        section = page.split(f"\n### {spec.id}\n", 1)[1].split("\n### ", 1)[0]
        assert section.count(spec.fix) == 1 and spec.title in section, spec.id
        assert f"[`{spec.id}`](#{spec.id})" in page, spec.id  # in its section's table


def test_the_generated_page_follows_the_docstrings():
    """A docstring's change reaches the page: the page is made from the specs, not kept beside them."""
    from tfdoctor.registry import all_checks
    from tfdoctor.report.catalogue_markdown import render_markdown, section_of

    specs = all_checks()
    assert [section_of(spec) for spec in specs].count("series") == sum(spec.judges_run for spec in specs)
    first = specs[0]
    renamed = type(first)(**{**first.__dict__, "title": "A title never written"})
    assert "A title never written" in render_markdown([renamed] + specs[1:])


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_its_heading(page):
    text = page.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        pending = linked.relative_to(ROOT).as_posix() in PENDING
        assert linked.exists() != pending, (f"{page.name} links to {target}, which is there: drop it from PENDING"
                                            if pending else f"{page.name} links to {target}, which does not exist")
        if pending:
            continue
        if anchor and linked.suffix == ".md":
            headings = {_anchor(line.lstrip("#").strip())
                        for line in linked.read_text(encoding="utf-8").splitlines() if line.startswith("#")}
            assert anchor in headings, f"{page.name} links to {target}: no such heading"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_ci_recipe_is_yaml_that_uploads_junit_and_sarif():
    yaml = pytest.importorskip("yaml")
    text = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    (recipe,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    steps = yaml.safe_load(recipe)["jobs"]["tfdoctor"]["steps"]
    runs = " ".join(step.get("run", "") for step in steps)
    assert "--format junit" in runs and "--format sarif" in runs
    uses = [step.get("uses", "") for step in steps]
    assert any(u.startswith("github/codeql-action/upload-sarif") for u in uses)
    assert any("junit" in u for u in uses)
