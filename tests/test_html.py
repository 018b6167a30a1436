"""--format html: one self-contained page with the figures, for `check` (a real run through the command),
for a watched run (fixtures/watch/healthy.py's series) and for `memory`; then both pages opened in
Debian's headless Chromium, which must parse them into figures with drawn content and paint a page
that is not blank.

No figure is golden text: what is asserted is structure (which figures, how many drawn segments, the
colours that carry meaning such as the leak cells), never matplotlib's floating-point coordinates.
Where TFDOCTOR_SCREENSHOT_DIR is set (CI), the screenshots are copied there.
"""

import copy
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from helpers import E2E, ROOT, tfdoctor
from tfdoctor.report.html import plotting_available
from tfdoctor.result import Report, Result
from tfdoctor.usercode.environment import REQUIRE_BROWSER, SCREENSHOT_DIR

pytestmark = E2E
needs_matplotlib = pytest.mark.skipif(not plotting_available(), reason="matplotlib is not installed "
                                                                       "(pip install 'tfdoctor[html]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LEAK_RED = "#d62728"  # report/figures.py's fail colour: the heat map's cells where an output reads a later token
SHOT_SIZE = (1200, 2000)


class Page(HTMLParser):
    """The figures of a page (data-figure name -> the <svg> text inside it) and its findings rows."""

    def __init__(self, text: str):
        super().__init__()
        self.figures: dict[str, list[str]] = {}
        self.rows: list[tuple[str, str]] = []  # (status class, check id)
        self.external: list[str] = []  # anything the browser would fetch: script, link, src, url(...)
        self._text = text
        self.feed(text)
        for match in re.finditer(r'data-figure="([^"]+)"[^>]*>.*?(<svg.*?</svg>)', text, re.S):
            self.figures.setdefault(match.group(1), []).append(match.group(2))
        self.rows = re.findall(r'<tr class="(\w+)"><td><span class="status"[^>]*>\w+</span></td><td class="id">'
                               r'([^<]+)</td>', text)

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "link", "iframe", "object", "embed"):
            self.external.append(tag)
        for name, value in attrs:
            if name in ("src", "href") or re.search(r"url\((?!#)", value or ""):
                self.external.append(f"{tag} {name}={value}")


def finding(result: Result, check_id: str) -> Result:
    result.id, result.title = check_id, "what was expected"
    return result


def drawn_points(svg: str) -> int:
    """Coordinates drawn by the <path d="..."> elements of one figure (the axes' own few included)."""
    return sum(len(re.findall(r"[-\d.]+ [-\d.]+", d)) for d in re.findall(r'<path[^>]* d="([^"]*)"', svg))


# ------------------------------------------------------------------ the pages, made once per module


@pytest.fixture(scope="module")
def check_page(tmp_path_factory):
    """A real `check --format html` of a model whose allowed mask was built with torch.triu, trained by
    the correct loop of fixtures/loops (so the loop checks draw too) at a traced memory shape."""
    out = tmp_path_factory.mktemp("html") / "check.html"
    done = tfdoctor("check", "fixtures/gpt_triu_mask.py:build", "--train", "fixtures/loops/correct.py:train",
                    "--train-batch", "8", "--train-seq", "64", "--format", "html", "--output", str(out))
    return done, out


@pytest.fixture(scope="module")
def watch_page(watch_audit, tmp_path_factory):
    """The page of fixtures/watch/healthy.py's watched run, with one failing finding added at step 123
    (the healthy run has none to mark)."""
    from tfdoctor.report import render

    report = copy.deepcopy(watch_audit("healthy"))
    report.results.append(finding(Result.failed("a planted finding", "none", {"step": 123}), "planted-judge"))
    out = tmp_path_factory.mktemp("html") / "watch.html"
    with open(out, "w", encoding="utf-8") as stream:
        render(report, "html", stream)
    return report, out


# ------------------------------------------------------------------ the pages as written


@needs_matplotlib
def test_check_page_draws_the_map_the_curves_and_the_memory(check_page):
    done, out = check_page
    assert done.code == 1, done.stderr  # future-leak and mask-direction fail
    page = Page(out.read_text(encoding="utf-8"))
    assert set(page.figures) >= {"dependency-map", "overfit", "grad-norm", "rate", "memory"}
    (heat_map,) = page.figures["dependency-map"]  # both mask checks judge one map: drawn once
    assert heat_map.count(f"fill: {LEAK_RED}") > 10  # the upper triangle: later tokens read (leak)
    for name in ("overfit", "grad-norm", "rate", "memory"):
        assert drawn_points(page.figures[name][0]) > 20, name
    statuses = dict((check_id, status) for status, check_id in page.rows)
    assert statuses["future-leak"] == statuses["mask-direction"] == "fail"
    assert page.rows[0][0] == "fail"  # worst first
    assert not page.external


@needs_matplotlib
def test_watch_page_draws_every_series_and_marks_the_finding(watch_page):
    report, out = watch_page
    page = Page(out.read_text(encoding="utf-8"))
    assert set(page.figures) >= {"loss", "grad-norm", "rate", "step-time", "throughput", "run-memory"}
    assert "scale" not in page.figures  # float32 run: no GradScaler, nothing to draw
    steps = len(report.series["steps"]["step"])
    loss = page.figures["loss"][0]
    assert drawn_points(loss) > steps  # the raw line and the smoothed one over every step
    evals = len(report.series["evals"]["step"])
    assert evals >= 5 and len(re.findall(r"<use[^>]*#ff7f0e", loss)) >= evals  # a marker per evaluation
    for name, (svg,) in page.figures.items():
        assert "planted-judge" in svg, f"{name} does not mark the finding's step"
    assert ("fail", "planted-judge") in page.rows
    assert not page.external


@needs_matplotlib
def test_watch_page_names_each_number_as_the_console_header_does(watch_page):
    """The loss, the throughput and the data wait of the real run: each figure's title says its number
    under the name the console's header gives it, and the header holds the same number."""
    import html as markup

    from tfdoctor.report.watch_header import watched_lines

    report, out = watch_page
    text = out.read_text(encoding="utf-8")
    captions = {name: markup.unescape(title) for name, title in
                re.findall(r'data-figure="([^"]+)"><figcaption>([^<]*)</figcaption>', text)}
    header = " ".join(line.plain for line in watched_lines(report))
    assert captions["loss"].startswith("Loss: ") and "(medians of the first and last 10 steps)" in captions["loss"]
    assert f"loss {captions['loss'][len('Loss: '):]}" in header
    median, wall = re.fullmatch(r"Throughput: ([\d,]+ tokens/s at the median step), ([\d,]+ wall-clock tokens/s)",
                                captions["throughput"]).groups()
    assert median in header and wall in header
    waited = re.fullmatch(r"Step time: (data wait [\d.]+% over the whole run)", captions["step-time"]).group(1)
    assert waited in header  # healthy.py trains from a DataLoader: measured
    assert "curves healthy" not in text  # the planted failure


@needs_matplotlib
def test_a_healthy_watch_page_says_curves_healthy_and_points_to_run(watch_audit):
    from tfdoctor.report.html import report_page

    page = report_page(watch_audit("healthy"))
    assert re.search(r'<p class="verdict"[^>]*>curves healthy</p>', page)
    assert "`tfdoctor run fixtures/watch/healthy.py` audits the model and the loop" in page


def test_render_accepts_only_what_it_can_draw():
    """A report without series or figures still makes a page: the findings table alone."""
    if not plotting_available():
        pytest.skip("matplotlib is not installed")
    from io import StringIO

    from tfdoctor.report.html import render

    report = Report("nothing drawn", [finding(Result.passed("fine"), "x")])
    out = StringIO()
    render(report, out)
    page = Page(out.getvalue())
    assert page.figures == {} and page.rows == [("pass", "x")]


@needs_matplotlib
def test_memory_page():
    done = tfdoctor("memory", "--batch", "64", "--seq", "2048", "--budget", "24GiB", "--format", "html")
    assert done.code == 1, done.stderr  # predicted out of memory
    page = Page(done.stdout)
    assert set(page.figures) == {"memory", "remedies"}
    assert all(drawn_points(svgs[0]) > 10 for svgs in page.figures.values())
    assert "OUT OF MEMORY" in done.stdout and not page.external


def test_help_and_the_reporters_import_no_matplotlib():
    code = ("import sys, tfdoctor.cli, tfdoctor.report, tfdoctor.report.html; "
            "print('matplotlib' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ,
                               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.skipif(plotting_available(), reason="matplotlib is installed: the usage error without it cannot be "
                                                 "seen here (and is not faked)")
def test_html_without_matplotlib_is_a_usage_error():
    done = tfdoctor("check", "fixtures/gpt_correct.py:build", "--format", "html")
    assert done.code == 2 and "pip install 'tfdoctor[html]'" in done.stderr


# ------------------------------------------------------------------ in a real browser


def browser():
    if CHROMIUM is None:
        if REQUIRE_BROWSER.get() == "1":
            pytest.fail(f"{REQUIRE_BROWSER.name}=1 and no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH (apt-get install chromium): the HTML is not opened in a browser")
    return CHROMIUM


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", *args, page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def painted(png: Path) -> tuple[tuple[int, int], int, int]:
    """(size, distinct colours, pixels of the leak red) of a screenshot."""
    from PIL import Image

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20) or []
        red = sum(count for count, (r, g, b) in colours if abs(r - 214) < 12 and abs(g - 39) < 12 and abs(b - 40) < 12)
        return rgb.size, len(colours), red


def keep(png: Path) -> None:
    folder = SCREENSHOT_DIR.get()
    if folder:
        target = Path(folder) if os.path.isabs(folder) else ROOT / folder
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, target / png.name)


@needs_matplotlib
@pytest.mark.parametrize("which", ["check", "watch"])
def test_chromium_renders_the_page(which, check_page, watch_page, tmp_path):
    out = (check_page if which == "check" else watch_page)[1]
    written = Page(out.read_text(encoding="utf-8"))
    dom = chromium(out, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = Page(dom.stdout)  # the document as the browser built it
    assert set(parsed.figures) == set(written.figures) and parsed.figures
    for name, svgs in parsed.figures.items():
        assert all(drawn_points(svg) > 10 for svg in svgs), name
    assert len(parsed.rows) == len(written.rows)
    png = tmp_path / f"tfdoctor-{which}.png"
    shot = chromium(out, tmp_path / "profile", f"--screenshot={png}", f"--window-size={SHOT_SIZE[0]},{SHOT_SIZE[1]}")
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    keep(png)
    size, colours, red = painted(png)
    assert size == SHOT_SIZE
    assert colours > 200  # figures, text and badges; a blank or unstyled page has a handful
    if which == "check":
        assert red > 2000  # the heat map's leak cells, painted


HOSTILE = '</pre><script>alert(1)</script><img src=x onerror=alert(2)> "quoted" & <b>bold</b>'


@needs_matplotlib
def test_user_strings_are_shown_not_obeyed():
    """A message, id, hint or piece of evidence is the user's text: escaped, never markup."""
    from io import StringIO

    from tfdoctor.report import render

    crash = finding(Result.errored(HOSTILE, HOSTILE, {"traceback": HOSTILE, HOSTILE: [HOSTILE],
                                                      "loss_curve": ["nan", 2.0, 1.0], "pre_clip_norms": ["inf"]}),
                    "overfit-batch")
    report = Report(HOSTILE, [crash, finding(Result.failed(HOSTILE, HOSTILE, {"step": 3}), HOSTILE)],
                    series={"steps": {"step": [0, 1], "loss": ["nan", 1.0]}})
    out = StringIO()
    render(report, "html", out)
    page = Page(out.getvalue())
    assert not page.external  # no <script>, no <img src>
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out.getvalue()
    assert set(page.figures) == {"loss", "overfit"}  # "nan" from JSON is a gap in the curve, not a category
