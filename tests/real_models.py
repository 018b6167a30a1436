"""Real libraries' models from tiny configs, built locally (no downloads)."""

import torch


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=None))


def x_transformers_decoder():
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=512, max_seq_len=64,
                              attn_layers=Decoder(dim=64, depth=2, heads=4))


CAUSAL_MODELS = {"hf-gpt2": hf_gpt2, "hf-llama": hf_llama, "x-transformers-decoder": x_transformers_decoder}
