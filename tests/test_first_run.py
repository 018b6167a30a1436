"""What a new user meets on a first run, beyond the report formats (tests/test_report.py): no
deprecation line that tfdoctor itself causes, the fix that names the SDPA convention, and a training
length the model cannot take refused in one line."""

import logging
import warnings

import pytest

from tfdoctor import run_checks


def test_the_battery_on_a_hugging_face_model_triggers_no_deprecation():
    """transformers 5 logs "`past_key_values`/`cache_params` are deprecated" once per process when its
    output's cache is read by the old name: tfdoctor reads it by the name the installed version has."""
    pytest.importorskip("transformers")
    from real_models import hf_gpt2, with_pad

    subject = with_pad(hf_gpt2)()
    heard: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: heard.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers says each warning once per process
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = run_checks(subject, skip="overfit-batch")
    finally:
        library.removeHandler(handler)
    assert not report.problems()
    said = heard + [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not [line for line in said if "deprecat" in line.lower()], said
