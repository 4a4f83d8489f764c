"""README.md and docs/*.md: every relative link reaches a file (and a heading, with a #fragment) that
git does not ignore (a fresh clone has it), the README stays a front door, its two commands are the
ones CI runs, the tables that quote committed results equal what scripts/docs_tables.py builds
from the rows, and the counts between value markers (encodings, tasks, sweep sizes, runs, study
costs, test cases, the suite's size) equal their sources."""
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
README_LINES = 160  # a front door: the default job, the quickstart, the glance tables, the docs
INSTALL_AND_RUN = "bash scripts/install.sh && python -m posbench encoding=rope task=copy"
INSTALL_AND_TEST = "bash scripts/install.sh dev && python -m pytest"


def prose_lines(text: str):
    """The lines outside fenced code blocks, with inline code spans removed."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [target for line in prose_lines(page.read_text()) for target in LINK.findall(line)]


def test_pages_exist():
    names = {p.name for p in PAGES}
    for page in ("encodings", "tasks", "configuration", "running", "results", "wandb", "performance", "studies",
                 "adding-an-encoding", "testing"):
        assert f"{page}.md" in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_linked_files_are_not_ignored_by_git():
    """A fresh clone has every file a page links: none matches .gitignore (the per-run figures under
    results/reference/ do, so a page links a study's own figures only)."""
    targets = sorted({str((page.parent / target.partition("#")[0]).resolve().relative_to(ROOT))
                      for page in PAGES for target in links(page)
                      if not re.match(r"[a-z][a-z0-9+.-]*:", target) and target.partition("#")[0]})
    try:
        check = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(targets),
                               capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if check.returncode not in (0, 1):  # 0: some are ignored, 1: none is
        pytest.skip(f"not a git checkout: {check.stderr.strip()}")
    assert check.stdout == "", f"linked but ignored by git (whitelist them with ! in .gitignore):\n{check.stdout}"


def test_slug_matches_github():
    assert slug("Model sizes: `scale_study`, sizes `xs` and `small` (3 seeds)") == \
        "model-sizes-scale_study-sizes-xs-and-small-3-seeds"
    assert slug("Logging to Weights & Biases") == "logging-to-weights--biases"


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < README_LINES
    assert INSTALL_AND_RUN in text and INSTALL_AND_TEST in text  # verbatim, in that order
    assert text.index(INSTALL_AND_RUN) < text.index(INSTALL_AND_TEST)
    assert INSTALL_AND_TEST in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command
    for page in PAGES[1:]:  # every docs page is linked from the README
        assert f"(docs/{page.name})" in text, page.name


def load_script():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_match_the_committed_rows(capsys):
    """Each generated table and inline value equals what its source gives (the suite's size: the next
    test); after a new reference run or a new config, `python scripts/docs_tables.py` rewrites them."""
    script = load_script()
    assert script.main(["--check", "--skip", "tests"]) == 0, capsys.readouterr().err


def whole_suite(session) -> int | None:
    """The suite's size when this session collected every test file and deselected tests by their marks alone
    (`-m`: the slow ones, by default) or not at all (a worker of pytest-xdist collects the whole suite too), else
    None."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    options = session.config.option
    if reporter is None or options.keyword or options.deselect:
        return None
    deselected = reporter.stats.get("deselected", [])
    files = {Path(str(item.path)).name for item in (*session.items, *deselected)}
    if files != {p.name for p in (ROOT / "tests").glob("test_*.py")}:
        return None
    return len(session.items) + len(deselected)


def test_the_documented_test_count_is_the_suites(request):
    """docs/testing.md's "over N tests" against this session's own collection: free, where a
    collection of its own would cost the suite seconds."""
    size = whole_suite(request.session)
    if size is None:
        pytest.skip("this session did not collect the whole suite (a file or -k given): no count to compare")
    script = load_script()
    quoted = [(page.name, m["body"]) for page in script.pages() for m in script.INLINE.finditer(page.read_text())
              if m["name"] == "tests"]
    assert quoted and all(body == script.tests_text(size) for _, body in quoted), (size, quoted)


def test_drift_is_caught(tmp_path, monkeypatch):
    script = load_script()
    page = tmp_path / "page.md"
    page.write_text("<!-- table:lm-memory -->\n| protocol | 32 |\n|---|---:|\n| stale | 1.00 |\n"
                    "<!-- /table:lm-memory -->\n")
    monkeypatch.setattr(script, "pages", lambda: [page])
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check"]) == 1
    assert "stale" in page.read_text()  # --check changes nothing
    assert script.main([]) == 0
    assert "segment recurrence, memory 64" in page.read_text() and "stale" not in page.read_text()
    assert script.main(["--check"]) == 0


@pytest.mark.parametrize("line,fixed", [
    ("over <!-- value:encodings -->30<!-- /value --> encodings", "over <!-- value:encodings -->{encodings}<!-- /value --> encodings"),
    ("(<!-- value:sweep-axes experiment=synthetic_suite -->22 × 19 × 3 = 1,254<!-- /value --> runs)",
     "(<!-- value:sweep-axes experiment=synthetic_suite -->{synthetic}<!-- /value --> runs)"),
    ("<!-- value:runs frontier time<2026-11-27 -->150<!-- /value --> runs, <!-- value:cost frontier -->8 h 30 min<!-- /value -->",
     "<!-- value:runs frontier time<2026-11-27 -->156<!-- /value --> runs, <!-- value:cost frontier -->{cost}<!-- /value -->"),
    ("<!-- value:tests -->over 3,900<!-- /value --> tests", "<!-- value:tests -->over 4,200<!-- /value --> tests"),
])
def test_a_wrong_count_is_caught_and_rewritten(tmp_path, monkeypatch, capsys, line, fixed):
    """A stale count in the prose fails --check, naming its line and both texts; without --check it is
    rewritten from its source (the suite's size given as --tests, as the session's test does)."""
    script = load_script()
    expected = fixed.format(encodings=script.encodings(), synthetic=script.sweep_axes("experiment=synthetic_suite"),
                            cost=script.cost("frontier"))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{line}\n")
    monkeypatch.setattr(script, "pages", lambda: [page])
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check", "--tests", "4250"]) == 1
    assert "page.md: line 2: value" in capsys.readouterr().err
    assert script.main(["--tests", "4250"]) == 0
    assert page.read_text() == f"intro\n{expected}\n"
    assert script.main(["--check", "--tests", "4250"]) == 0
