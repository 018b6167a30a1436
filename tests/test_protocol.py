"""The worker <-> supervisor protocol (tfdoctor/process/protocol.py): one word per event, JSON both ways, and the
worker's documented events are the ones it sends."""

import ast
import io
import json
from pathlib import Path

from tfdoctor.memory.analytic import Config, judge
from tfdoctor.process.protocol import Ended, Event, Phase, decode_result, decode_verdict, encode_result, encode_verdict
from tfdoctor.result import Result

ROOT = Path(__file__).resolve().parent.parent


def _sent_and_handled():
    """Event members the worker sends (channel.send(Event.X, ...); `watch`'s live feed,
    process/live.py, sends its own) and the supervisor reads (kind == Event.X)."""
    def members(path: str) -> set[str]:
        tree = ast.parse((ROOT / "tfdoctor" / path).read_text())
        return {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Event"}
    return members("process/worker.py") | members("process/live.py"), members("process/supervisor.py")


def test_every_event_is_sent_and_read():
    sent, handled = _sent_and_handled()
    assert sent == handled == {e.name for e in Event}


def test_protocol_docstring_names_every_event():
    import re

    import tfdoctor.process.protocol as protocol

    for event in Event:  # as a word of its own: "exit" is not found inside "rank-exit"
        assert re.search(rf"(?<![\w-]){re.escape(event.value)}(?![\w-])", protocol.__doc__), event


def test_words_compare_and_serialise_as_their_strings():
    assert Ended.RANK_EXIT == "rank-exit" and f"{Phase.LOADING}" == "loading"
    assert json.dumps({"event": Event.USAGE_ERROR}) == '{"event": "usage-error"}'
    assert {e.value for e in Ended} == {"done", "usage-error", "timeout", "exit", "vanished", "internal-error",
                                        "interrupted", "rank-exit"}


def test_result_round_trip():
    result = Result.failed("seen 3", "fix it", {"ratio": 0.5, "curve": [1.0, 2.0]})
    result.id, result.title = "init-loss", "Initial loss"
    back = decode_result(json.loads(json.dumps(encode_result(result))))
    assert back.to_record() == result.to_record()


def test_analytic_verdict_round_trip_renders_the_same():
    from tfdoctor.report import render

    verdict = judge(Config(batch=8, seq=512).validated(), 1 << 30, "test")
    back = decode_verdict(json.loads(json.dumps(encode_verdict(verdict))))
    assert back == verdict
    for fmt in ("rich", "json"):
        before, after = io.StringIO(), io.StringIO()
        render(verdict, fmt, before, 100)
        render(back, fmt, after, 100)
        assert after.getvalue() == before.getvalue()


def test_traced_verdict_round_trip():
    import torch

    from tfdoctor.memory.gpt import GPT
    from tfdoctor.memory.traced_judge import judge_traced
    from tfdoctor.subject import Subject

    torch.manual_seed(0)
    model = GPT(vocab=100, d_model=32, n_head=2, n_layer=1, positions=16, attention="sdpa")
    verdict = judge_traced(Subject(model, vocab_size=100), "gpt", 2, 16, 1 << 20, "test")
    back = decode_verdict(json.loads(json.dumps(encode_verdict(verdict))))
    assert back == verdict
