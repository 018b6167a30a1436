"""docs/checks.md, the check catalogue as a page, written from the registry: each check's id, title,
what it judges, its documentation and its fix, in the report's order. The checks' docstrings are the
one text (`tfdoctor checks ID` prints the same), so a fix is written once, in its check.

    python -m tfdoctor.report.catalogue_markdown            # rewrite docs/checks.md
    python -m tfdoctor.report.catalogue_markdown --check    # exit 1 when docs/checks.md is stale

tests/test_docs.py compares the committed page with a fresh one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tfdoctor.report.catalogue import applies_to

PAGE = Path(__file__).resolve().parents[2] / "docs" / "checks.md"

# The sections, in the order a run meets them: what each check reads (CheckSpec.inputs) says where.
SECTIONS = (
    ("model", "Model checks", "`tfdoctor check TARGET` and `tfdoctor run SCRIPT`: the model's own behaviour, "
                              "measured on random tokens."),
    ("trace", "Training-loop checks", "`tfdoctor check TARGET --train MODULE:FN` and `tfdoctor run SCRIPT`: "
                                      "what the loop really called, recorded (the rank checks compare the "
                                      "ranks of a `--nproc` or torchrun job)."),
    ("series", "Run judges", "`tfdoctor watch SCRIPT` and the TfdoctorCallback: the whole run's series, "
                             "judged at its end."),
)


def section_of(spec) -> str:
    return "series" if spec.judges_run else "trace" if "trace" in spec.inputs else "model"


def render_markdown(specs) -> str:
    lines = ["# Check catalogue", "",
             "Generated from the checks' own documentation by `python -m tfdoctor.report.catalogue_markdown`: "
             "edit a check's docstring, never this page (`tests/test_docs.py` compares them). "
             "`tfdoctor checks` prints the same catalogue, `tfdoctor checks ID` one check.", "",
             "Every check gives pass, warn, fail or skip (with the reason where it does not apply); "
             "`error` is tfdoctor's own crash.", ""]
    for key, heading, where in SECTIONS:
        chosen = [spec for spec in specs if section_of(spec) == key]
        lines += [f"- [{heading}](#{_anchor(heading)}): {len(chosen)}"]
    for key, heading, where in SECTIONS:
        lines += ["", f"## {heading}", "", where, "", "| id | what it makes sure of |", "| --- | --- |"]
        chosen = [spec for spec in specs if section_of(spec) == key]
        lines += [f"| [`{spec.id}`](#{spec.id}) | {spec.title} |" for spec in chosen]
        for spec in chosen:
            lines += ["", f"### {spec.id}", "", f"**{spec.title}.** Applies to: {applies_to(spec)}.", ""]
            for paragraph in spec.doc.split("\n\n"):
                if not paragraph.startswith("Fix:"):
                    lines += [" ".join(paragraph.split()), ""]
            lines += [f"**Fix:** {spec.fix}" if spec.fix else "**Fix:** (none written)"]
    return "\n".join(lines) + "\n"


def _anchor(heading: str) -> str:
    return heading.lower().replace(" ", "-")


def main(argv=None) -> int:
    from tfdoctor.registry import all_checks

    parser = argparse.ArgumentParser(prog="python -m tfdoctor.report.catalogue_markdown")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/checks.md is not the generated page")
    args = parser.parse_args(argv)
    page = render_markdown(all_checks())
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page
        print(f"{PAGE} is stale: run python -m tfdoctor.report.catalogue_markdown" if stale else f"{PAGE} is current")
        return int(stale)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
