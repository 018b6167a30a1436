import pytest
import torch

from helpers import build_fixture
from real_models import CAUSAL_MODELS
from tfdoctor import Subject, run_checks
from tfdoctor.checks.masking import classify
from tfdoctor.probes.dependency import dependency_map

MASK_CHECKS = ["future-leak", "mask-direction"]

# fixture -> (future-leak status, mask-direction pattern)
FIXTURE_EXPECTATIONS = {
    "gpt_correct": ("pass", "causal"),
    "gpt_blocked_triu": ("pass", "causal"),
    "gpt_sdpa": ("pass", "causal"),
    "gpt_big_init": ("pass", "causal"),
    "gpt_triu_mask": ("fail", "upper"),
    "gpt_no_mask": ("fail", "none"),
    "gpt_off_by_one": ("fail", "off-by-one"),
    "gpt_ignores_tokens": ("pass", "other"),
    # Zero-initialised output projections / residual gates: judged on the wiring, not the init.
    "gpt_zero_init": ("pass", "causal"),
    "gpt_zero_init_no_mask": ("fail", "none"),
    "gpt_zero_init_smear": ("pass", "causal"),
    "gpt_zero_init_smear_no_mask": ("fail", "none"),
    "gpt_rezero": ("pass", "causal"),
    "gpt_rezero_no_mask": ("fail", "none"),
}


@pytest.mark.parametrize("name", sorted(FIXTURE_EXPECTATIONS))
def test_mask_checks_on_fixtures(name, checks_report):
    leak_status, pattern = FIXTURE_EXPECTATIONS[name]
    report = checks_report(name, MASK_CHECKS)
    assert report["future-leak"].status.value == leak_status
    assert report["mask-direction"].details["pattern"] == pattern
    assert report["mask-direction"].status.value == ("pass" if pattern == "causal" else "fail")


def test_future_leak_names_first_leaking_pair_and_map():
    result = run_checks(build_fixture("gpt_triu_mask"), only="future-leak")["future-leak"]
    assert result.details["first_leak"]["output_position"] == 0
    assert result.details["first_leak"]["input_position"] == 1
    assert result.details["leaking_pairs"] == 32 * 31 // 2  # triu leaks every future pair
    drawn = result.details["dependency_map"]
    assert drawn[0][-1] == 2 and drawn[-1][0] == 0  # top-right leaks, bottom-left sees nothing
    assert "torch.tril" in result.hint


def test_off_by_one_reports_look_ahead_of_one_token_per_layer():
    result = run_checks(build_fixture("gpt_off_by_one"), only="mask-direction")["mask-direction"]
    assert result.details["look_ahead"] == 2  # two layers, each one token ahead
    assert "diagonal" in result.hint


def test_dependency_map_costs_one_forward_per_chunk_not_per_position():
    calls = []
    model = build_fixture("gpt_correct").eval()

    def forward(ids):
        calls.append(ids.shape[0])
        return model(ids)

    base = torch.randint(0, 96, (48,))
    dmap = dependency_map(forward, base, 96, None)
    assert len(calls) == 1 and calls[0] == 50  # the base twice (a determinism check) + one row per position
    assert dmap.noise == 0.0
    assert dmap.future_pairs() == []
    assert bool(dmap.depends.diagonal().all())


def test_dependency_map_chunks_large_inputs(monkeypatch):
    from tfdoctor.probes import dependency

    monkeypatch.setattr(dependency, "CHUNK_LOGIT_BYTES", 4 * 48 * 96 * 10)  # 8 perturbed rows per forward
    model = build_fixture("gpt_triu_mask").eval()
    dmap = dependency_map(model, torch.randint(0, 96, (48,)), 96, None)
    assert dmap.forwards == 6
    assert len(dmap.future_pairs()) == 48 * 47 // 2


def test_leak_tolerance_sees_softmax_denominator_leak():
    """Probabilities zeroed after the softmax: the future only moves the denominator, a ~1e-4 effect."""

    class ZeroAfterSoftmax(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.head = torch.nn.Linear(16, 50)

        def forward(self, ids):
            x = self.emb(ids)
            T = ids.shape[1]
            probs = (x @ x.transpose(-1, -2) / 4).softmax(-1)
            probs = probs * torch.tril(torch.ones(T, T))  # masked after the softmax
            return self.head(probs @ x)

    result = run_checks(ZeroAfterSoftmax(), only="future-leak")["future-leak"]
    assert result.status.value == "fail"
    assert result.details["first_leak"]["relative_change"] < 1e-1  # small, yet well over float noise


@pytest.mark.parametrize(
    "matrix, pattern",
    [
        (torch.tril(torch.ones(8, 8, dtype=torch.bool)), "causal"),
        (torch.triu(torch.ones(8, 8, dtype=torch.bool)), "upper"),
        (torch.ones(8, 8, dtype=torch.bool), "none"),
        (torch.tril(torch.ones(8, 8, dtype=torch.bool), diagonal=1), "off-by-one"),
        (torch.zeros(8, 8, dtype=torch.bool), "other"),
        (torch.eye(8, dtype=torch.bool), "other"),
        # sliding-window attention: a band of the past, still causal
        (torch.tril(torch.ones(8, 8, dtype=torch.bool)) & torch.triu(torch.ones(8, 8, dtype=torch.bool), -2), "causal"),
    ],
)
def test_classify_patterns(matrix, pattern):
    assert classify(matrix)[0] == pattern


@pytest.mark.parametrize("name", sorted(CAUSAL_MODELS))
def test_real_causal_models_pass_mask_checks(name):
    report = run_checks(CAUSAL_MODELS[name](), only=MASK_CHECKS)
    assert [r.status.value for r in report.results] == ["pass", "pass"], [r.message for r in report.results]


def test_mask_checks_skip_encoders_with_reason():
    report = run_checks(Subject(build_fixture("gpt_no_mask"), kind="encoder"), only=MASK_CHECKS)
    for result in report.results:
        assert result.status.value == "skip"
        assert "both ways" in result.message


def test_probe_tokens_never_contain_pad_id():
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build_fixture("gpt_correct")

        def forward(self, ids):
            seen.append(ids.clone())
            return self.inner(ids)

    run_checks(Subject(Spy(), pad_id=5, vocab_size=96), only=MASK_CHECKS + ["init-loss"])
    assert seen and all(not bool((ids == 5).any()) for ids in seen)


def test_a_model_random_in_eval_mode_warns_instead_of_crying_leak():
    class AlwaysDropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build_fixture("gpt_correct")

        def forward(self, ids):
            x = self.inner(ids)
            return torch.nn.functional.dropout(x, 0.1)  # training=True by default: random in eval too

    report = run_checks(AlwaysDropout(), only=MASK_CHECKS)
    for result in report.results:
        assert result.status.value == "warn"
        assert "training=self.training" in result.hint


ZERO_INIT_FIXTURES = ["gpt_zero_init", "gpt_zero_init_no_mask", "gpt_zero_init_smear", "gpt_zero_init_smear_no_mask",
                      "gpt_rezero", "gpt_rezero_no_mask"]


@pytest.mark.parametrize("name", ZERO_INIT_FIXTURES)
def test_zero_init_models_are_judged_with_their_paths_opened(name):
    report = run_checks(build_fixture(name), only=MASK_CHECKS)
    for result in report.results:
        probe = result.details["zero_init_probe"]
        assert probe["judged"] == "opened"
        assert probe["fresh_past_share"] < 0.1  # the fresh model mixes (almost) nothing
        assert probe["opened_pairs"] > probe["fresh_pairs"]
        assert "jittered, then restored" in result.message
    assert report["mask-direction"].details["forwards"] == 2  # the fresh map and the opened one


def test_zero_init_probe_names_what_it_jittered():
    probe = run_checks(build_fixture("gpt_zero_init"), only="future-leak")["future-leak"].details["zero_init_probe"]
    assert probe["examples"] == ["h.0.attn.c_proj.weight", "h.0.mlp.c_proj.weight", "h.1.attn.c_proj.weight",
                                 "h.1.mlp.c_proj.weight", "lm_head.weight"]
    # 2 layers x (attention 64x64 + MLP 256x64 output projections) + the 96x64 lm_head
    assert probe["zero_entries"] == 2 * (64 * 64 + 256 * 64) + 96 * 64
    assert probe["gates"] == []
    rezero = run_checks(build_fixture("gpt_rezero"), only="future-leak")["future-leak"].details["zero_init_probe"]
    assert rezero["gates"] == ["blocks.0.resweight", "blocks.1.resweight"]


def test_the_fresh_smear_map_alone_looks_causal():
    """The partial map a smear-only fresh model shows would pass: the opened map is what catches it."""
    from tfdoctor.modes import evaluation

    model = build_fixture("gpt_zero_init_smear_no_mask")
    with evaluation(model):
        fresh = dependency_map(model, torch.randint(0, 96, (32,)), 96, None)
    assert fresh.future_pairs() == [] and classify(fresh.depends)[0] == "causal"
    assert fresh.past_share() < 0.1  # one token back only
    result = run_checks(model, only="future-leak")["future-leak"]
    assert result.status.value == "fail" and result.details["leaking_pairs"] == 32 * 31 // 2


@pytest.mark.parametrize("name", ["gpt_zero_init", "gpt_rezero_no_mask"])
def test_zero_init_probe_leaves_the_weights_bit_for_bit(name):
    model = build_fixture(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run_checks(model, only=MASK_CHECKS)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_a_frozen_zero_parameter_is_architecture_and_stays_closed():
    """A mask kept as a frozen parameter is part of the wiring: jittering it would invent a leak."""
    from tfdoctor.probes.perturb import held_at_init

    model = build_fixture("gpt_zero_init")
    model.frozen_mask = torch.nn.Parameter(torch.tril(torch.ones(4, 4)), requires_grad=False)
    names = [name for name, _ in held_at_init(model)]
    assert "frozen_mask" not in names and "lm_head.weight" in names


def test_a_correctly_initialised_model_is_measured_once():
    result = run_checks(build_fixture("gpt_correct"), only="future-leak")["future-leak"]
    assert "zero_init_probe" not in result.details and result.details["forwards"] == 1


# A transformers release whose SDPA path sees the next token (eager correct), as one released model did.
RELEASE_LEAK_CHECKS = ["future-leak", "mask-direction"]


def test_a_release_leaking_under_sdpa_fails_a_model_left_on_the_default():
    model = build_fixture("hf_release_leak")
    assert model.config._attn_implementation == "sdpa"  # the library's own choice
    for result in run_checks(model, only=RELEASE_LEAK_CHECKS).results:
        assert result.status.value == "fail", result.message
        assert result.message.startswith("with attn_implementation='sdpa':")
        assert result.details["failing_implementations"] == ["sdpa"]
        assert result.details["configured_implementation"] == "sdpa"  # the default is what it runs


def test_a_model_on_the_default_is_judged_by_the_default_and_warned_off_eager():
    """The implementation a model runs is the resolved one, the library's default included: a leak
    under eager only (which it does not run) is a warning naming the switch, not a failure."""
    model = build_fixture("hf_release_leak")
    model.leaking = "eager"
    result = run_checks(model, only="future-leak")["future-leak"]
    assert result.status.value == "warn", result.message
    assert result.message.startswith("with attn_implementation='eager' (not 'sdpa', the one this model runs")
    assert "do not switch to eager" in result.hint
    assert result.details["configured_implementation"] == "sdpa"


def test_a_model_configured_eager_is_judged_by_eager_and_warned_off_sdpa():
    import transformers

    model = build_fixture("hf_release_leak_eager")
    report = run_checks(model, only=RELEASE_LEAK_CHECKS)
    for result in report.results:
        assert result.status.value == "warn", result.message
        assert result.message.startswith("with attn_implementation='sdpa' (not 'eager', the one this model runs, "
                                         "which passes):")
        assert f"do not switch to sdpa on this release (transformers {transformers.__version__})" in result.hint
        assert result.details["configured_implementation"] == "eager"
        assert result.details["failing_implementations"] == ["sdpa"]
        assert result.details["status_under_other"] == "fail"
    assert report["future-leak"].details["first_leak"]["input_position"] == 1  # the evidence is sdpa's map
    assert report["mask-direction"].details["pattern"] == "off-by-one"
    assert model.config._attn_implementation == "eager"  # restored after the sdpa run
    assert report.exit_code(strict=False) == 0 and report.exit_code(strict=True) == 1  # a CI gate stays open


def test_switching_to_eager_after_loading_counts_as_configured():
    model = build_fixture("hf_release_leak")
    model.set_attn_implementation("eager")
    assert run_checks(model, only="future-leak")["future-leak"].status.value == "warn"


def test_a_leak_under_the_configured_implementation_still_fails():
    model = build_fixture("hf_release_leak_eager")
    model.leaking = "eager"  # the release's eager path is the broken one, and the model runs it
    result = run_checks(model, only="future-leak")["future-leak"]
    assert result.status.value == "fail"
    assert result.message.startswith("with attn_implementation='eager':")
    assert result.details["configured_implementation"] == "eager"
    assert result.details["failing_implementations"] == ["eager"]


def test_a_correct_model_configured_eager_passes_under_both():
    from real_models import hf_gpt2

    model = hf_gpt2()
    model.set_attn_implementation("eager")
    for result in run_checks(model, only=RELEASE_LEAK_CHECKS).results:
        assert result.status.value == "pass", result.message
        assert result.message.endswith("same with attn_implementation eager and sdpa")
        assert result.details["configured_implementation"] == "eager"


@pytest.mark.parametrize("name, expected", [("build", "pass"), ("build_one_way", "fail")])
def test_weak_but_real_encoder_mixing_is_judged_on_its_margin_over_noise(name, expected):
    import encoder_weak_mixing

    result = run_checks(getattr(encoder_weak_mixing, name)(), only="bidirectional-encoder")["bidirectional-encoder"]
    assert result.status.value == expected, result.message
    assert result.details["dependency_floor"] < result.details["tolerance"]
    if expected == "pass":
        assert result.details["weak_pairs"] > 0 and "depend only weakly" in result.message
    else:
        assert result.details["pattern"] == "causal"


def test_a_fresh_reformer_encoder_is_bidirectional():
    """Reformer's local + LSH attention mixes the far tokens of a fresh init at ~1e-5 of the logit
    scale, across the usual tolerance: judged on its margin over the noise, it passes."""
    from transformers import ReformerConfig, ReformerForMaskedLM

    torch.manual_seed(0)
    model = ReformerForMaskedLM(ReformerConfig(
        vocab_size=320, hidden_size=64, num_attention_heads=4, attention_head_size=16, feed_forward_size=128,
        attn_layers=["local", "lsh"], axial_pos_shape=[8, 8], axial_pos_embds_dim=[32, 32],
        max_position_embeddings=64, local_attn_chunk_length=16, lsh_attn_chunk_length=16, num_buckets=4,
        is_decoder=False, pad_token_id=0))
    result = run_checks(model, only="bidirectional-encoder", seq_len=64)["bidirectional-encoder"]
    assert result.status.value == "pass", result.message
    assert result.details["pattern"] == "none"


@pytest.mark.parametrize("name, expected", [("build", "pass"), ("build_no_mixing", "warn")])
def test_a_windowed_encoder_reads_both_sides(name, expected):
    import encoder_windowed

    result = run_checks(getattr(encoder_windowed, name)(), only="bidirectional-encoder")["bidirectional-encoder"]
    assert result.status.value == expected, result.message
    if expected == "pass":
        assert (result.details["look_ahead"], result.details["look_behind"]) == (3, 3)
    else:
        assert "does not mix positions" in result.message


class _SelfOnlyAttention(torch.nn.Module):
    """Planted bug: an attention whose allowed mask is the identity (torch.eye where torch.tril was
    meant): every position attends to itself only, a map a bigram model shows too."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)  # (B, T, d)
        T = ids.shape[1]
        scores = (q @ k.mT).masked_fill(~torch.eye(T, dtype=torch.bool), float("-inf"))
        return self.head(scores.softmax(-1) @ v)


def test_a_model_that_mixes_no_positions_has_no_mask_to_name():
    """A bigram drafter calls no attention: mask-direction skips saying so (issue 17, item 12); an
    attention masked to the identity gives the same map and still fails."""
    bigram = run_checks(build_fixture("gpt_bigram"), only=MASK_CHECKS)
    assert bigram["future-leak"].status.value == "pass"
    assert bigram["mask-direction"].status.value == "skip", bigram["mask-direction"].message
    assert "mixes no positions" in bigram["mask-direction"].message
    self_only = run_checks(_SelfOnlyAttention(), only="mask-direction")["mask-direction"]
    assert self_only.status.value == "fail", self_only.message


def test_rows_read_together_are_not_called_random():
    """Two identical rows that answer differently while the same batch run twice agrees are not
    randomness: a model whose rows are parts of one sample (MusicGen's codebooks) skips, a model that
    mixes its batch rows (x.view(T, B, d) for a transpose) warns with that cause."""
    grouped = run_checks(build_fixture("codebook_rows"), only="future-leak", batch_first=True)["future-leak"]
    assert grouped.status.value == "skip" and "parts of one sample" in grouped.message, grouped.message
    mixed = run_checks(build_fixture("gpt_mixes_batch"), only="future-leak,mask-direction")
    for result in mixed:
        assert result.status.value == "warn" and "rows are read together" in result.message, result.message
        assert "random" not in result.message and "transpose" in result.hint


def test_a_mask_finding_names_the_user_s_line_where_attention_is_computed():
    # issue 29: the model findings name the file and line of the attention, as the loop findings do
    from helpers import FIXTURES, build_fixture
    from tfdoctor import run_checks

    report = run_checks(build_fixture("gpt_triu_mask"), only=["future-leak", "mask-direction"])
    source = (FIXTURES / "gpt_triu_mask.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if ".softmax(" in text)
    for result in report:
        assert result.status.value == "fail"
        assert result.details["location"].endswith(f"gpt_triu_mask.py:{line}"), result.details
        assert result.details["call"] == "the attention softmax"
    sdpa = run_checks(build_fixture("gpt_sdpa_blocked_triu"), only="future-leak")["future-leak"]
    assert (sdpa.details["call"] == "F.scaled_dot_product_attention"
            and "gpt_sdpa_blocked_triu.py:" in sdpa.details["location"])
