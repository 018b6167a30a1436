"""Real libraries' task heads from tiny configs, built locally (no downloads): sequence classifiers of
the common encoder and decoder families, a regression head and a token classifier."""

_SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=80, pad_token_id=1, num_labels=3)


def _hf(config_name: str, model_name: str, **config):
    def build():
        import transformers

        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))

    build.__name__ = model_name
    return build


CLASSIFIERS = {
    "bert": _hf("BertConfig", "BertForSequenceClassification", **_SMALL),
    "roberta": _hf("RobertaConfig", "RobertaForSequenceClassification", **_SMALL),
    "xlm-roberta": _hf("XLMRobertaConfig", "XLMRobertaForSequenceClassification", **_SMALL),
    "electra": _hf("ElectraConfig", "ElectraForSequenceClassification", embedding_size=64, **_SMALL),
    "albert": _hf("AlbertConfig", "AlbertForSequenceClassification", embedding_size=32, **_SMALL),
    "deberta-v2": _hf("DebertaV2Config", "DebertaV2ForSequenceClassification", **_SMALL),
    "distilbert": _hf("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=512, dim=64, n_layers=2,
                      n_heads=4, hidden_dim=128, max_position_embeddings=64, pad_token_id=0, num_labels=3),
    "modernbert": _hf("ModernBertConfig", "ModernBertForSequenceClassification", **{
        **_SMALL, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3}),
    "gpt2": _hf("GPT2Config", "GPT2ForSequenceClassification", vocab_size=512, n_positions=64, n_embd=64, n_layer=2,
                n_head=4, pad_token_id=0, bos_token_id=0, eos_token_id=0, num_labels=3),
    "bert-regression": _hf("BertConfig", "BertForSequenceClassification", **{**_SMALL, "num_labels": 1}),
    "bert-token": _hf("BertConfig", "BertForTokenClassification", **{**_SMALL, "num_labels": 5}),
}
