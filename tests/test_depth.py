import math

import pytest
import torch
import torch.nn as nn

from catalogue import DEPTH
from helpers import build_fixture
from tfdoctor import run_checks

# fixture -> depth-signal's status
FIXTURE_EXPECTATIONS = {
    "gpt_double_residual": "warn",
    "gpt_position_randn": "warn",
    "postln_very_deep": "warn",
    "gpt_deep_unscaled": "warn",
    "gpt_deep_scaled": "pass",
    "gpt_correct": "pass",
    "postln_deep": "pass",
    "gpt_rezero": "pass",
    "gpt_bigram": "skip",
}


def judged(model_or_subject):
    return run_checks(model_or_subject, only=DEPTH)["depth-signal"]


@pytest.mark.parametrize("name", sorted(FIXTURE_EXPECTATIONS))
def test_depth_signal_on_fixtures(name, checks_report):
    result = checks_report(name, DEPTH)["depth-signal"]
    assert result.status.value == FIXTURE_EXPECTATIONS[name], result.message


def test_a_residual_added_twice_is_named_as_growth(checks_report):
    result = checks_report("gpt_double_residual", DEPTH)["depth-signal"]
    details = result.details
    assert details["stack"] == "blocks" and details["blocks"] == 6
    assert details["growth_over_sqrt_depth"] > 5  # the stream doubles per block: ~2^5 over sqrt(6)
    assert details["grad_ratio_first_to_last"] > 1e-2 and details["position_to_token"] < 2  # only growth
    assert "grows" in result.message and "add the residual once" in result.hint


def test_a_randn_position_table_is_named_with_both_tables(checks_report):
    result = checks_report("gpt_position_randn", DEPTH)["depth-signal"]
    assert result.details["embeddings"] == {"token": "tok_emb", "position": "pos"}
    assert 30 < result.details["position_to_token"] < 80  # std 1 against std 0.02
    assert "grows" not in result.message and "std=0.02" in result.hint


def test_a_very_deep_post_ln_stack_starves_its_first_blocks(checks_report):
    result = checks_report("postln_very_deep", DEPTH)["depth-signal"]
    details = result.details
    assert details["stack"] == "blocks.layers" and details["blocks"] == 96
    assert details["grad_ratio_first_to_last"] < 1e-2
    assert details["growth_over_sqrt_depth"] < 1  # post-norm: the stream itself stays at RMS 1
    assert "norm_first=True" in result.hint


def test_a_deep_stack_without_output_scaling_is_measured_from_the_embeddings(checks_report):
    """From the first block's output it grows about sqrt(48) like any healthy stack; from the
    embeddings' output it grows ~300x, ten times its twin with the 1/sqrt(2 * n_layer) scaling."""
    result = checks_report("gpt_deep_unscaled", DEPTH)["depth-signal"]
    details = result.details
    assert details["blocks"] == 48 and details["growth_over_sqrt_depth"] < 3  # what the first block's output misses
    assert details["growth_from_input"] > 150
    assert math.isclose(details["growth_from_input"], details["output_rms"][-1] / details["input_rms"])
    assert 0.02 < details["input_rms"] < 0.04  # the embeddings (std 0.02, token + position) entering block 0
    assert "from the embeddings' output" in result.message and "1/sqrt(2 * n_layer)" in result.hint
    twin = checks_report("gpt_deep_scaled", DEPTH)["depth-signal"].details
    assert twin["growth_from_input"] < 50 and details["growth_from_input"] > 5 * twin["growth_from_input"]


def test_the_stream_entering_the_first_block_is_the_argument_shaped_like_its_output():
    """A float attention bias handed to each block before the stream is not the stream."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, bias, x):  # bias (T, T): added to the scores of an attention left out here
            return x + self.fc(self.ln(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks, self.head = (nn.Embedding(32, 16), nn.ModuleList(Block() for _ in range(4)),
                                                nn.Linear(16, 32))
            nn.init.normal_(self.emb.weight, std=0.5)

        def forward(self, ids):
            T = ids.shape[1]
            bias = torch.full((T, T), -1e4).triu(1)  # RMS ~7000: far from the stream's 0.5
            x = self.emb(ids)
            for block in self.blocks:
                x = block(bias, x)
            return self.head(x)

    result = judged(Model())
    assert 0.3 < result.details["input_rms"] < 0.7, result.details["input_rms"]


def test_the_same_stack_in_pre_norm_keeps_its_gradients_level():
    model = build_fixture("postln_very_deep")
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True, norm_first=True)
    model.blocks = nn.TransformerEncoder(layer, 24, enable_nested_tensor=False)
    result = judged(model)
    assert result.status.value == "pass", result.message
    assert result.details["grad_ratio_first_to_last"] > 0.5


def _gpt2(n_layer):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=n_layer, n_head=4))


def _llama(n_layer):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))


@pytest.mark.parametrize("n_layer", [2, 12])
@pytest.mark.parametrize("factory, stack", [(_gpt2, "transformer.h"), (_llama, "model.layers")], ids=["gpt2", "llama"])
def test_hugging_face_stacks_pass_at_several_depths(factory, stack, n_layer):
    result = judged(factory(n_layer))
    assert result.status.value == "pass", result.message
    assert result.details["stack"] == stack and result.details["blocks"] == n_layer


def test_a_hugging_face_position_table_drawn_at_std_1_warns():
    model = _gpt2(2)
    nn.init.normal_(model.transformer.wpe.weight, std=1.0)  # the token table keeps GPT-2's std 0.02
    result = judged(model)
    assert result.status.value == "warn", result.message
    assert result.details["embeddings"] == {"token": "transformer.wte", "position": "transformer.wpe"}


def test_no_gradient_mode_or_weight_is_left_changed():
    model = build_fixture("gpt_correct")
    model.blocks[1].eval()
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert judged(model).status.value == "pass"
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == flags
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_blocks_that_do_not_run_once_each_are_skipped():
    from tfdoctor.checks.depth import judge_depth

    signal = {"stack": "h", "block_class": "Block", "input_rms": 1.0, "output_rms": [1.0, 1.0],
              "grad_norms": [1.0, 1.0], "calls": [2, 0], "token_rms": None, "position_rms": None, "embeddings": {},
              "mode": "eval"}
    assert judge_depth(signal).status.value == "skip"
    signal["calls"] = [1, 1]
    assert judge_depth(signal).status.value == "pass"
    signal["output_rms"] = [1.0, 10.0]  # 10x over 2 blocks: too few to tell growth with depth (OLMo-2)
    assert judge_depth(signal).status.value == "pass"
    signal.update(output_rms=[1.0, 2.0, 5.0, 20.0], grad_norms=[1.0] * 4, calls=[1] * 4)  # 20x over 4: 10 x sqrt(4)
    assert judge_depth(signal).status.value == "warn"
    # from the embeddings: GLM-4's tiny config, 2 blocks, 103x (the first block's jump to its own scale)
    signal.update(input_rms=0.0203, output_rms=[1.46, 2.09], grad_norms=[1.0] * 2, calls=[1] * 2)
    assert judge_depth(signal).status.value == "pass"
    signal.update(output_rms=[1.46, 1.8, 2.09, 2.4], grad_norms=[1.0] * 4, calls=[1] * 4)  # 118x over 4 blocks
    assert judge_depth(signal).status.value == "warn" and "from the embeddings" in judge_depth(signal).message
    signal.update(input_rms=1.0, output_rms=[1.0, 1.0], grad_norms=[1e-4, 1.0], calls=[1, 1])
    assert judge_depth(signal).status.value == "warn"
    assert math.isclose(judge_depth(signal).details["grad_ratio_first_to_last"], 1e-4)


def test_the_stack_is_the_list_of_blocks_not_a_list_of_heads():
    from tfdoctor.probes.depth import find_stack

    assert find_stack(build_fixture("codebook_rows")) is None  # a ModuleList of bare Linear heads
    assert find_stack(build_fixture("gpt_correct")).name == "blocks"
    assert find_stack(build_fixture("postln_deep")).name == "blocks.layers"


def test_frozen_blocks_are_said_to_be_frozen():
    model = build_fixture("gpt_correct")
    for param in model.blocks.parameters():
        param.requires_grad_(False)
    result = judged(model)
    assert result.status.value == "pass" and "frozen" in result.message, result.message


def test_a_model_whose_own_backward_raises_is_skipped_with_the_reason():
    """xLSTM's native chunkwise kernel (chunk_size 16 at the probe's 32 tokens) edits its state in place
    between the forward and the backward: torch refuses the backward, in eval() and in train() alike.
    That is the model's own failure, said in a skip, not tfdoctor's crash (error)."""
    from transformers import xLSTMConfig, xLSTMForCausalLM

    torch.manual_seed(0)
    model = xLSTMForCausalLM(xLSTMConfig(vocab_size=256, hidden_size=64, embedding_dim=64, num_hidden_layers=2,
                                         num_blocks=2, num_heads=4, qk_dim_factor=1.0, chunk_size=16))
    result = judged(model)
    assert result.status.value == "skip", result.message
    assert result.details["phase"] == "backward" and "modified by an inplace operation" in result.message


def test_a_first_block_that_normalises_the_embeddings_itself_is_measured_from_that_norm():
    """RWKV draws its embeddings at ~1e-4 and block 0 renormalises them (`pre_ln`, a norm the other blocks
    lack): from the raw embeddings the stream would grow ~9000x, a false alarm on a correct model."""
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    model = RwkvForCausalLM(RwkvConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                                       intermediate_size=128, context_length=64))
    result = judged(model)
    assert result.status.value == "pass", result.message
    assert result.details["input_at"] == "rwkv.blocks.0.pre_ln" and result.details["growth_from_input"] < 100
