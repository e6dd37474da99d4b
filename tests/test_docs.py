"""The user documentation: a README a user can read through, and links that lead somewhere.

CI runs the test command the README gives, and a fresh machine starts from its first commands, so they
stay at its top."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
MAX_README_LINES = 250


def anchors(page):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short_enough_to_read():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_readme_opens_with_the_demo_and_the_test_command():
    text = README.read_text()
    first_section = text.split("\n## ", 1)[0]
    assert "\n    ./scripts/demo\n    ./scripts/test\n" in first_section
    assert "`./scripts/demo`" in first_section and "`./scripts/test`" in first_section


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_the_benchmark_plots_the_docs_show_are_committed():
    page = ROOT / "docs" / "benchmarks.md"
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())
    assert images
    assert all((page.parent / image).is_file() for image in images)
