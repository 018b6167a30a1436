"""A watched run's figures as a person reads them, on hand-built series (no process, no torch): every
number the console header, the live view and the HTML titles show is named for what it is and reads
the same wherever it is shown; a data wait nobody measured says so; several parameter groups' rates
are told apart; a live finding cut to the terminal's width keeps its cause; a run whose curves pass
says "curves healthy" and what watch does not judge.

Rendered at fixed widths into StringIO consoles. The series' numbers are chosen so that what is
printed does not depend on floating-point rounding (exact binary fractions, margins far from a
rounding edge)."""

import io
import re

import pytest
from rich.console import Console

from tfdoctor.report.dashboard import RunView
from tfdoctor.report.html import plotting_available
from tfdoctor.report.run_summary import DATA_WAIT_NOT_MEASURED
from tfdoctor.report.shortened import shortened
from tfdoctor.result import Report, Result, Status
from tfdoctor.watching.series import RunSeries, StepRow, row_dict

needs_matplotlib = pytest.mark.skipif(not plotting_available(), reason="matplotlib is not installed")
STEPS = 40
SLOW_EVERY = 10  # an evaluation every 10 steps: that step's wall time holds it


def run(loader: bool = True, rates=((1 / 1024, 1 / 1024),), groups=None) -> RunSeries:
    """A 40-step run: loss 4.5 falling by 1/16 a step; 1024 tokens a step in 0.25 s (1 s on every
    tenth, where an evaluation ran), 1/16 s of it waiting for the DataLoader when there is one; the
    rates of each parameter group: `rates` pairs (low, high), low for the first half, high after."""
    steps = []
    for i in range(STEPS):
        lrs = [low if i < STEPS // 2 else high for low, high in rates]
        steps.append(StepRow(step=i, loss=4.5 - i / 16, grad_norm=0.5, lrs=lrs, group_norms=[0.25] * len(lrs),
                             wall=1.0 if i % SLOW_EVERY == SLOW_EVERY - 1 else 0.25,
                             data_wait=1 / 16 if loader else 0.0, tokens=1024, batches=i + 1 if loader else 0,
                             rss=256 * 2 ** 20))
    facts = {"ended": "finished", "seconds": 12.5, "vocab": 64, "device": "cpu", "scaler": False}
    if loader:
        facts["loader"] = {"num_workers": 0, "pin_memory": False, "batch_size": 16, "name": "DataLoader"}
    if groups is not None:
        facts["param_groups"] = groups
    return RunSeries(steps, [], facts)


def series_report(series: RunSeries, results=None, target="watch train.py") -> Report:
    results = results if results is not None else [passed("loss-spike"), passed("data-wait")]
    return Report(target, results, series=series.to_dict(), discovered={"steps": len(series), "ended": "finished",
                                                                          "seconds": 12.5})


def passed(check_id: str) -> Result:
    result = Result.passed("fine")
    result.id = check_id
    return result


def console_text(report: Report, width: int = 100) -> str:
    from tfdoctor.report.console import render

    out = io.StringIO()
    render(report, out, width=width)
    return out.getvalue()


def header(report: Report) -> str:
    from tfdoctor.report.watch_header import watched_lines

    return "\n".join(line.plain for line in watched_lines(report))


def live_text(series: RunSeries, found=(), width: int = 100) -> str:
    view = RunView("train.py")
    view.rows([row_dict(row) for row in series.steps])
    view.findings(list(found))
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False).print(view.renderable(width))
    return out.getvalue()


def titles(report: Report) -> dict[str, str]:
    from tfdoctor.report.run_figures import run_figures

    return {drawn.name: drawn.title for drawn in run_figures(report)}


def svg_of(report: Report, name: str) -> str:
    from tfdoctor.report.run_figures import run_figures

    return next(drawn.svg for drawn in run_figures(report) if drawn.name == name)


# ------------------------------------------------------------------ data wait: measured or not


def test_a_run_without_a_dataloader_says_its_data_wait_was_not_measured():
    report = series_report(run(loader=False))
    assert DATA_WAIT_NOT_MEASURED in header(report) and "%" not in header(report)
    live = live_text(run(loader=False))
    assert DATA_WAIT_NOT_MEASURED in " ".join(live.split()) and "data wait 0" not in live


def test_a_measured_data_wait_is_a_share_of_the_steps_after_the_first():
    # 39 steps after the first wait 1/16 s each, of 4 x 1 s + 35 x 0.25 s = 12.75 s: 19.1%
    said = "data wait 19.1% over the whole run"
    assert said in header(series_report(run()))
    assert "data wait 19.1% so far" in live_text(run())


@needs_matplotlib
def test_the_step_time_figure_names_an_unmeasured_wait_and_draws_no_wait_line():
    unmeasured = series_report(run(loader=False))
    assert titles(unmeasured)["step-time"] == f"Step time: {DATA_WAIT_NOT_MEASURED}"
    assert "waiting for the next batch" not in svg_of(unmeasured, "step-time")
    measured = series_report(run())
    assert titles(measured)["step-time"] == "Step time: data wait 19.1% over the whole run"
    assert "waiting for the next batch" in svg_of(measured, "step-time")


# ------------------------------------------------------------------ one name per number


@needs_matplotlib
def test_the_loss_and_the_throughput_read_the_same_under_one_name_everywhere():
    report = series_report(run())
    head, live, figures = header(report), " ".join(live_text(run()).split()), titles(report)
    # the loss: medians of the first and last 10 steps (4.5 - 4.5/16 and 4.5 - 34.5/16), in both
    ends = "4.219 to 2.344 (medians of the first and last 10 steps)"
    assert f"loss {ends}" in head and figures["loss"] == f"Loss: {ends}"
    # wall-clock: 39 x 1024 tokens over 12.75 s; the median step: 1024 tokens in 0.25 s
    assert "3,132 wall-clock tokens/s" in head and "4,096 tokens/s at the median step" in head
    assert figures["throughput"] == "Throughput: 4,096 tokens/s at the median step, 3,132 wall-clock tokens/s"
    assert "3,132 wall-clock tokens/s" in live
    shown = {}  # every "<number> <name>" across the three: one number per name
    for text in (head, live, *figures.values()):
        for number, name in re.findall(r"([\d,.]+%?) (wall-clock tokens/s|tokens/s at the median step)", text):
            shown.setdefault(name, set()).add(number)
    assert shown == {"wall-clock tokens/s": {"3,132"}, "tokens/s at the median step": {"4,096"}}


# ------------------------------------------------------------------ parameter groups


GROUPS = [{"parameters": 1_200_000, "weight_decay": 0.1}, {"parameters": 3_100, "weight_decay": 0.0}]


@needs_matplotlib
def test_each_parameter_group_s_rates_are_named_where_they_differ():
    series = run(rates=((1 / 1024, 1 / 128), (1 / 4096, 1 / 512)), groups=GROUPS)
    report = series_report(series)
    head = header(report)
    assert "rate 0.000977 to 0.00781 in group 0 (weight decay 0.1, 1.2M parameters)" in head
    assert "rate 0.000244 to 0.00195 in group 1 (weight decay 0, 3.1K parameters)" in head
    svg = svg_of(report, "rate")
    assert "group 0 (weight decay 0.1, 1.2M parameters)" in svg and "group 1 (weight decay 0, 3.1K parameters)" in svg
    assert "group 0 0.007812, group 1 0.001953" in live_text(series)


@needs_matplotlib
def test_groups_on_one_schedule_are_said_once():
    series = run(rates=((1 / 1024, 1 / 128), (1 / 1024, 1 / 128)), groups=GROUPS)
    report = series_report(series)
    assert "rate 0.000977 to 0.00781 in every group (2)" in header(report)
    assert "every parameter group (2)" in svg_of(report, "rate")
    assert "0.007812 in every group (2)" in live_text(series)
    assert "in every group" not in header(series_report(run()))  # one group: nothing to tell apart


# ------------------------------------------------------------------ a live finding cut to fit keeps its cause


SPIKE = ("loss spiked at step 120 (batch 121): 3.134 against a band of 1.875 ± 0.062 over the previous 25 steps "
         "(peak 3.332 at step 123), back within its band 12 steps later; the gradient norm stayed at 1.1x its "
         "median; the rate of the update just before was 42x the highest of the band's steps; it undid 59% of "
         "the progress the run had made")


@pytest.mark.parametrize("width, expected", [
    (400, None),  # the whole message
    (150, "loss spiked at step 120: 3.134 against a band of 1.875 ± 0.062 over the previous 25 steps, back "
          "within its band 12 steps later; the rate jumped 42x"),  # the asides dropped, then the later clauses
    (120, "loss spiked at step 120: 3.134 against a band of 1.875 ± 0.062 over the previous 25 steps; the "
          "rate jumped 42x"),  # the leading clause's parts that fit
    (60, "loss spiked at step 120; the rate jumped 42x"),  # its head
    (42, "loss spiked at step…; the rate jumped 42x"),  # the head cut, the cause whole
])
def test_shortened_keeps_what_happened_where_and_why(width, expected):
    line = shortened(SPIKE, width, "the rate jumped 42x")
    assert line == (expected or SPIKE) and len(line) <= width


def test_shortened_without_a_cause_keeps_the_head_of_the_leading_clause():
    assert shortened(SPIKE, 40) == "loss spiked at step 120"
    assert shortened("a short message", 40) == "a short message"
    assert len(shortened(SPIKE, 10)) == 10


def spiked_run() -> RunSeries:
    """A run whose rate jumps 32-fold for one update at step 59, and whose loss jumps the step after."""
    steps = []
    for i in range(100):
        loss = 4.0 - i / 64 + (2.0 if i == 60 else 0.0) + (1 / 256 if i % 2 else 0.0)
        steps.append(StepRow(step=i, loss=loss, grad_norm=0.5 + (i % 3) / 16, lrs=[1 / 32 if i == 59 else 1 / 1024],
                             wall=0.25, tokens=1024, batches=i + 1))
    return RunSeries(steps, [], {"ended": "finished", "vocab": 64})


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_live_view_keeps_a_real_spike_finding_s_cause_at_any_width(width):
    from tfdoctor.checks.curves import loss_spike
    from tfdoctor.process.live import findings

    result = loss_spike(spiked_run())
    result.id = "loss-spike"
    assert result.status is Status.FAIL and len(result.message) > 200, result.message
    (found,) = findings([result])
    assert found["cause"] == "the rate jumped 32x"
    screen = live_text(spiked_run(), [found], width)
    line = next(line for line in screen.splitlines() if "loss spiked at step 60" in line)
    assert "the rate jumped 32x" in line and len(line) <= width, screen


def test_the_live_view_puts_a_finding_under_its_id_on_a_narrow_terminal():
    found = {"id": "loss-spike", "status": "fail", "message": SPIKE, "step": 120, "cause": "the rate jumped 42x"}
    screen = live_text(run(), [found], width=50)
    assert "  loss spiked at step 120; the rate jumped 42x" in screen, screen
    assert all(len(line) <= 50 for line in screen.splitlines())


# ------------------------------------------------------------------ curves healthy: what watch judges, and what not


def test_a_run_whose_judges_pass_says_curves_healthy_and_what_watch_does_not_judge():
    text = console_text(series_report(run()))
    verdict, pointer = text.split("— ")[-1].split("\n", 1)
    assert verdict == "curves healthy"
    assert "`tfdoctor run train.py` audits the model and the loop" in " ".join(pointer.split())
    assert "a model that reads the future" in pointer


def test_a_warning_is_not_curves_healthy():
    warned = Result.warned("slow", "more workers")
    warned.id = "data-wait"
    text = console_text(series_report(run(), [passed("loss-spike"), warned]))
    verdict, pointer = text.split("— ")[-1].split("\n", 1)
    assert verdict == "healthy" and "audits the model" in pointer


def test_a_failing_run_gets_no_pointer_and_a_check_report_is_unchanged():
    failed = Result.failed("spiked", "fix it")
    failed.id = "loss-spike"
    text = console_text(series_report(run(), [failed]))
    assert text.strip().splitlines()[-1].endswith("— 1 problem(s) found") and "tfdoctor run" not in text
    plain = console_text(Report("gpt.py:build", [passed("future-leak")]))
    assert plain.strip().splitlines()[-1] == "1 pass — healthy"


@pytest.mark.parametrize("target, command", [("watch -m pkg.train", "tfdoctor run -m pkg.train"),
                                             ("watch Trainer GPT2LMHeadModel", "tfdoctor run SCRIPT")])
def test_the_pointer_names_the_watched_script(target, command):
    assert f"`{command}`" in " ".join(console_text(series_report(run(), target=target)).split())


@needs_matplotlib
def test_the_html_page_says_curves_healthy_and_points_to_run():
    from tfdoctor.report.html import report_page

    page = report_page(series_report(run()))
    assert re.search(r'<p class="verdict"[^>]*>curves healthy</p>', page)
    assert "`tfdoctor run train.py` audits the model and the loop" in page
