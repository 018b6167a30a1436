"""The catalogue of planted bugs (tests/catalogue.py): every check flags its bad fixtures and passes its
good ones, with the exact status of each, and every registered check id has a row."""

import pytest

from catalogue import PLANTED, name


def _rows():
    for check_id, (bad, good) in PLANTED.items():
        for side, cases in (("bad", bad), ("good", good)):
            for case, status in cases:
                # a case judged on processes of its own (the 2-rank runs) is end to end
                marks = [pytest.mark.e2e] if case[0] == "ranks" else []
                yield pytest.param(check_id, case, status, id=f"{check_id}-{side}-{name(case)}", marks=marks)


@pytest.fixture
def judged(checks_report, loop_audit, rank_digests, watch_audit):
    """case -> check id -> Result, from the family's shared run of the case."""
    from helpers import judge_ranks

    def run(case):
        kind = case[0]
        if kind == "model":
            _, fixture, checks, train, fields = case
            return checks_report(fixture, checks, train=train, **dict(fields))
        if kind == "loop":
            return loop_audit(case[1])
        if kind == "watch":
            return watch_audit(*case[1:])
        return judge_ranks(rank_digests(case[1]))

    return run


@pytest.mark.parametrize("check_id, case, status", list(_rows()))
def test_planted_bug_has_its_exact_status(check_id, case, status, judged):
    result = judged(case)[check_id]
    assert result.status.value == status, result.message


def test_every_registered_check_has_a_row_with_a_bad_and_a_good_fixture():
    from tfdoctor.registry import all_checks

    ids = [spec.id for spec in all_checks()]
    assert list(PLANTED) == ids  # in the catalogue's order, none missing, none unknown
    for check_id, (bad, good) in PLANTED.items():
        assert bad and good, check_id
        assert all(status in ("fail", "warn") for _, status in bad), check_id
        assert all(status == "pass" for _, status in good), check_id
