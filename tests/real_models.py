"""Real libraries' models from tiny configs, built locally (no downloads)."""


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


def hf_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64, pad_token_id=0))


def hf_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, pad_token_id=0, decoder_start_token_id=0))


def hf_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64))


def x_transformers_encoder():
    """x-transformers takes its padding mask as `mask=` (True = keep): its users pass it, so do we."""
    from x_transformers import Encoder, TransformerWrapper

    from tfdoctor import Subject

    model = TransformerWrapper(num_tokens=512, max_seq_len=64, attn_layers=Encoder(dim=64, depth=2, heads=4))
    return Subject(model, pad_id=0, kind="encoder", forward=lambda m, ids: m(ids, mask=ids != 0))


def with_pad(factory, pad_id=0):
    """A causal model as trained on left-padded batches: Hugging Face models get attention_mask."""

    def build():
        from tfdoctor import Subject

        return Subject(factory(), pad_id=pad_id)

    return build


# Every correct real model, as users would hand it to tfdoctor; none may fail or error.
ALL_MODELS = {
    **CAUSAL_MODELS,
    "hf-gpt2-padded": with_pad(hf_gpt2),
    "hf-llama-padded": with_pad(hf_llama),
    "hf-bert": hf_bert,
    "hf-t5": hf_t5,
    "hf-bart": hf_bart,
    "x-transformers-encoder": x_transformers_encoder,
}


def _hf(config_name: str, model_name: str, **config):
    def build():
        import transformers

        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))

    return build


_SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

# More architectures the battery must stay quiet on: other position schemes (RoBERTa's pad-offset
# positions, rotary, Gemma's scaled embeddings), grouped-query and sliding-window attention.
MORE_MODELS = {
    "hf-roberta": _hf("RobertaConfig", "RobertaForMaskedLM", max_position_embeddings=80, **_SMALL),
    "hf-distilbert": _hf("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=512, dim=64, n_layers=2,
                         n_heads=4, hidden_dim=128, max_position_embeddings=64),
    "hf-gpt-neox": _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", max_position_embeddings=64, **_SMALL),
    "hf-qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, max_position_embeddings=64, **_SMALL),
    "hf-gemma": _hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=16,
                    max_position_embeddings=64, pad_token_id=0, **_SMALL),
    "hf-mistral-sliding-window": _hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2,
                                     max_position_embeddings=128, sliding_window=8, **_SMALL),
    "hf-mbart": _hf("MBartConfig", "MBartForConditionalGeneration", vocab_size=512, d_model=64, encoder_layers=2,
                    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                    decoder_ffn_dim=128, max_position_embeddings=64),
}


def hf_blt():
    """Tiny BLT (transformers 5.25): its cached decoding raises in the library (use_cache off so that
    its forward runs at all)."""
    from transformers import BltConfig, BltForCausalLM

    sub = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, head_dim=16,
               max_position_embeddings=256, sliding_window=64, num_hidden_layers=1)
    return BltForCausalLM(BltConfig(
        vocab_size=260, max_position_embeddings=256, patch_size=4, patching_mode=None, patch_in_forward=False,
        encoder_hash_byte_group_vocab=1000, encoder_hash_byte_group_size=[3, 4], local_attention_window_len=64,
        use_cache=False, patcher_config=dict(sub, vocab_size=260),
        encoder_config=dict(sub, hidden_size_global=64, vocab_size=260),
        decoder_config=dict(sub, hidden_size_global=64, vocab_size=260), global_config=sub))


def hf_xlstm():
    """Tiny xLSTM (transformers 5.25) as configured by default (use_cache=True): its backward refuses
    the state it updated in place. qk_dim_factor=1 (the default 0.5 does not run at this size)."""
    from transformers import xLSTMConfig, xLSTMForCausalLM

    return xLSTMForCausalLM(xLSTMConfig(vocab_size=512, hidden_size=64, embedding_dim=64, num_hidden_layers=2,
                                        num_blocks=2, num_heads=4, chunk_size=16, qk_dim_factor=1.0))
