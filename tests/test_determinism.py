import pytest
import torch
import torch.nn as nn

from catalogue import DETERMINISM
from helpers import build_fixture
from real_models import hf_bert, hf_gpt2, hf_llama, hf_t5
from tfdoctor import run_checks

# fixture -> eval-determinism's status
FIXTURE_EXPECTATIONS = {
    "gpt_functional_dropout": "fail",
    "gpt_dropout_unused": "warn",
    "gpt_functional_dropout_mode": "pass",
    "gpt_correct": "pass",
    "gpt_sdpa": "pass",
    "postln_deep": "pass",
}


def judged(model_or_subject):
    return run_checks(model_or_subject, only=DETERMINISM)["eval-determinism"]


@pytest.mark.parametrize("name", sorted(FIXTURE_EXPECTATIONS))
def test_eval_determinism_on_fixtures(name, checks_report):
    result = checks_report(name, DETERMINISM)["eval-determinism"]
    assert result.status.value == FIXTURE_EXPECTATIONS[name], result.message


def test_functional_dropout_is_named_with_its_size_and_the_block_it_runs_in(checks_report):
    result = checks_report("gpt_functional_dropout", DETERMINISM)["eval-determinism"]
    pair = result.details["eval_pair"]
    assert pair["relative"] > 0.01  # p = 0.1 on the residual stream: a tenth of it zeroed
    assert pair["origin"] == "blocks.0"  # F.dropout runs in the block's own forward
    assert pair["first_module"] == "blocks.0.ln2"  # the first module that reads the dropped stream
    assert not result.details["eval_same_seed"]["relative"]  # the same seed gives the same logits
    assert "blocks.0" in result.message and "F.dropout" in result.hint


class Noise(nn.Module):
    """A random op left in a forward (noise meant for training only)."""

    def forward(self, x):
        return x + 0.01 * torch.randn_like(x)


def test_a_random_op_inside_a_module_is_named_as_that_module():
    model = build_fixture("gpt_correct")
    model.blocks[1].mlp[1] = nn.Sequential(nn.GELU(), Noise())
    result = judged(model)
    assert result.status.value == "fail", result.message
    assert result.details["eval_pair"]["origin"] == "blocks.1.mlp.1.1"


class Counter(nn.Module):
    """A forward that carries state between calls: every call shifts the output a little more."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + 0.01 * self.calls


def test_state_carried_between_calls_warns_and_is_not_called_randomness():
    model = build_fixture("gpt_correct")
    model.blocks[0].mlp[1] = nn.Sequential(nn.GELU(), Counter())
    result = judged(model)
    assert result.status.value == "warn", result.message
    assert "same RNG seed" in result.message and result.details["eval_same_seed"]["relative"] > 0


def test_dropout_declared_and_never_applied_names_the_declaration(checks_report):
    result = checks_report("gpt_dropout_unused", DETERMINISM)["eval-determinism"]
    assert result.details["declared_dropout"] == ["h.0.attn.dropout = 0.1", "h.1.attn.dropout = 0.1"]
    assert result.details["train_pair"]["max_abs_difference"] == 0
    assert "dropout_p" in result.hint


@pytest.mark.parametrize("factory", [hf_gpt2, hf_bert, hf_t5], ids=["gpt2", "bert", "t5"])
def test_hugging_face_models_with_dropout_pass_and_vary_in_train(factory):
    result = judged(factory())
    assert result.status.value == "pass", result.message
    assert result.details["declared_dropout"] and result.details["train_pair"]["relative"] > 1e-3


def test_hugging_face_models_without_dropout_pass_without_a_train_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    no_dropout = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    for model in (hf_llama(), no_dropout):
        result = judged(model)
        assert result.status.value == "pass", result.message
        assert result.details["declared_dropout"] == [] and result.details["train_pair"] is None


def test_hugging_face_model_with_dropout_in_eval_fails():
    """A real library's model with a functional dropout patched in without training=: named there."""
    model = hf_gpt2()
    mlp = model.transformer.h[1].mlp
    original = mlp.forward
    mlp.forward = lambda hidden_states: nn.functional.dropout(original(hidden_states), 0.1)
    result = judged(model)
    assert result.status.value == "fail", result.message
    assert result.details["eval_pair"]["origin"] == "transformer.h.1.mlp"


def test_modes_rng_weights_and_buffers_are_put_back():
    from tfdoctor.probes.stochastic import measure_randomness

    model = build_fixture("gpt_correct")
    model.blocks[0].mlp.append(nn.BatchNorm1d(32))  # a train() forward moves its running statistics
    model.train()
    model.blocks[1].eval()
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 96, (2, 32))
    rng = torch.random.get_rng_state()
    measured = measure_randomness(model, lambda: model(ids), seed=0)
    assert measured.train_pair is not None and measured.train_pair.differs
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_layer_drop_alone_is_not_judged_never_applied():
    """LayerDrop (whole layers skipped, p = 0.1 over 4 layers) keeps every layer in 66% of draws: under run
    seed 5 four train() forwards keep them all, which is chance, not a dropout left out."""
    from transformers import BartConfig, BartForConditionalGeneration

    model = BartForConditionalGeneration(BartConfig(
        vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.1, decoder_layerdrop=0.1))
    for seed in (0, 5):
        result = run_checks(model, only=DETERMINISM, seed=seed)["eval-determinism"]
        assert result.status.value == "pass", result.message
        assert all("layerdrop" in declared for declared in result.details["declared_dropout"])


def test_a_dropout_outside_the_module_tree_never_sees_eval():
    """gpt_mlp_namespace keeps an nn.Dropout in a SimpleNamespace (its planted bug is optimizer-coverage's):
    model.eval() never reaches it, so it drops in eval(), inside each block's forward."""
    result = judged(build_fixture("gpt_mlp_namespace"))
    assert result.status.value == "fail", result.message
    assert result.details["eval_pair"]["origin"] == "blocks.0"
