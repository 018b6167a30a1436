"""Tiny random-init Hugging Face models, one per model type, from the library's own classes.

    HF_SWEEP_TYPE=llama tfdoctor check bench/hf_tiny_configs.py:build --format json
    HF_SWEEP_TYPE=llama@bf16 ...        # the same model built with dtype=torch.bfloat16
    HF_SWEEP_TYPE=bert/mlm ...          # the masked-LM class where the type's main class is another one
    HF_SWEEP_TYPE=bert/qa ...           # a task head: /seqcls, /tokcls, /qa (question answering), /mc (multiple choice)

The type's default config is shrunk generically (hidden 64, 2 layers, 4 heads / 2 kv heads,
intermediate 128, vocab <= 512 with the special token ids kept below it); OVERRIDES holds the few
per-model fixes where the generic shrink does not build. Used by bench/hf_sweep.py.
"""

import os

# Key names -> tiny value. Applied to every nested config dict too (text_config, encoder, ...).
HIDDEN = {"hidden_size", "d_model", "n_embd", "n_embed", "emb_dim", "embed_dim", "dim", "hidden_dim",
          "d_latents", "word_embed_proj_dim", "embedding_size", "model_dim", "d_embed", "embedding_dim"}
LAYERS = {"num_hidden_layers", "n_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers",
          "num_decoder_layers", "num_encoder_layers", "num_self_attends_per_block", "depth", "num_blocks"}
HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
         "decoder_attention_heads", "num_self_attention_heads", "num_cross_attention_heads",
         "num_attention_heads_per_layer"}
KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
            "num_key_value_groups_heads"}
HEAD_DIM = {"head_dim", "attention_head_size", "d_kv", "kv_channels", "d_head", "v_head_dim"}
INTER = {"intermediate_size", "d_ff", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
         "feed_forward_size", "moe_intermediate_size", "shared_expert_intermediate_size", "d_inner",
         "ffn_hidden_size", "expert_intermediate_size", "intermediate_size_mlp", "moe_ffn_hidden_size"}
EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"}
VOCAB = 512
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "mask_token_id",
                 "sep_token_id", "cls_token_id", "unk_token_id", "forced_bos_token_id", "forced_eos_token_id",
                 "image_token_id", "image_token_index", "video_token_id", "audio_token_id",
                 "boi_token_id", "eoi_token_id", "eos_token_index", "lang_id")

# Per-model fixes applied after the generic shrink (flat keys; "a.b" reaches a nested config).
OVERRIDES = {
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_shape": [8, 8], "axial_pos_embds_dim": [32, 32],
                 "max_position_embeddings": 64, "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16,
                 "num_buckets": 4, "attention_head_size": 16, "num_attention_heads": 4},
    "perceiver": {"d_latents": 64, "num_latents": 16, "max_position_embeddings": 64},
    "funnel": {"block_sizes": [1, 1], "block_repeats": [1, 1], "d_head": 16, "n_head": 4},
    "big_bird": {"attention_type": "original_full"},
    "bigbird_pegasus": {"attention_type": "original_full"},
    "longformer": {"attention_window": [16, 16]},
    "led": {"attention_window": [16, 16]},
    "xlnet": {"d_head": 16},
    "mra": {"block_per_row": 4, "num_blocks": 4},
    "esmc": {"num_key_value_heads": 4},
    "dots3_note": {"text_config.num_key_value_heads": 4},
    "dots3_note_text": {"num_key_value_heads": 4},
    "mamba2": {"num_heads": 8},
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    # Hybrids whose default config has no attention layer (its forward raises in get_seq_length): one of each.
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16,
              "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16,
                         "layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_dt_rank": 8},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # MLA with an indexer: the kv heads are the heads
    "axk2": {"num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16},
    "deepseek_v32": {"num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16},
    "glm_moe_dsa": {"num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16},
    "recurrent_gemma": {"num_hidden_layers": 3},  # block_types cycles recurrent, recurrent, attention
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
}


def _shrink_value(key, value, depth):
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if key in HIDDEN:
        return min(value, 64)
    if key in LAYERS:
        return min(value, 2)
    if key in HEADS:
        return min(value, 4)
    if key in KV_HEADS:
        return min(value, 2) if value > 0 else value
    if key in HEAD_DIM:
        return min(value, 16)
    if key in INTER:
        return min(value, 128)
    if key in EXPERTS:
        return min(value, 4)
    if key in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k"):
        return min(value, 2)
    if key in ("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "num_expert_group"):
        return min(value, 1)
    if key in ("kv_lora_rank", "q_lora_rank"):
        return min(value, 32)
    if key in ("qk_rope_head_dim", "qk_nope_head_dim"):
        return min(value, 8)
    if key in ("vocab_size", "unpadded_vocab_size"):
        return min(value, VOCAB)
    if key in ("num_codebooks",):
        return min(value, 2)
    return value


def _layer_count(d):
    return next(((k, d[k]) for k in sorted(LAYERS) if isinstance(d.get(k), int) and not isinstance(d[k], bool)),
                (None, None))


def _fix_lists(orig, d):
    """Per-layer lists and dicts cut to the kept layers: the first of each kind of layer, at least 2."""
    key, L = _layer_count(orig)
    if not L or L <= 2:
        return
    per_layer = [k for k, v in orig.items() if len(v if isinstance(v, (list, str)) else ()) == L
                 and (isinstance(v, list) or "pattern" in k)]
    keep = []
    for k in per_layer:
        seen = set()
        for i, v in enumerate(orig[k]):
            if isinstance(v, (list, dict)):
                v = repr(v)
            if v not in seen:
                seen.add(v)
                if i not in keep:
                    keep.append(i)
    keep = sorted(keep)[:4]
    for i in range(L):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    keep = sorted(keep)
    for k in LAYERS:
        if isinstance(d.get(k), int) and not isinstance(d[k], bool) and orig.get(k) == L:
            d[k] = len(keep)
    for k in per_layer:
        v = [orig[k][i] for i in keep]
        d[k] = "".join(v) if isinstance(orig[k], str) else [_shrink_value(k, x, 1) for x in v]
    for k, v in orig.items():
        if isinstance(v, dict) and v and all(str(x).isdigit() for x in v):  # per_layer_config {layer: ...}
            d[k] = {str(keep.index(int(x))) if isinstance(x, str) else keep.index(x): y for x, y in v.items()
                    if int(x) in keep}


def _fix_token_ids(d):
    vocab = d.get("vocab_size")
    if not isinstance(vocab, int):
        return
    used = set()
    for key in TOKEN_ID_KEYS:
        value = d.get(key)
        if isinstance(value, int) and value >= vocab:
            new = vocab - 1 - len(used)
            while new in used:
                new -= 1
            d[key] = new
        elif isinstance(value, list):
            d[key] = [v if v < vocab else vocab - 1 for v in value if isinstance(v, int)]
        if isinstance(d.get(key), int):
            used.add(d[key])


def shrink(d, depth=0):
    """The config dict `d`, shrunk in place (nested configs too)."""
    orig = dict(d)
    for key, value in list(d.items()):
        if isinstance(value, dict) and key not in ("id2label", "label2id", "rope_parameters", "rope_scaling"):
            shrink(value, depth + 1)
        else:
            d[key] = _shrink_value(key, value, depth)
    _fix_lists(orig, d)
    _fix_token_ids(d)
    # kv heads must divide heads
    heads = next((d[k] for k in HEADS if isinstance(d.get(k), int)), None)
    for k in KV_HEADS:
        if isinstance(d.get(k), int) and heads and d[k] > 0 and heads % d[k]:
            d[k] = 1
    # Fields whose default None the model reads as a number (the library's default config does not build)
    if "head_dim" in d and d["head_dim"] is None and heads and any(isinstance(d.get(k), int) for k in HIDDEN):
        d["head_dim"] = 16
    for k in KV_HEADS:
        if k in d and d[k] is None and heads:
            d[k] = 2
    if "num_experts_per_tok" in d and d["num_experts_per_tok"] is None:
        d["num_experts_per_tok"] = 2
    if isinstance(d.get("rotary_dim"), int):
        d["rotary_dim"] = min(d["rotary_dim"], 8)
    if isinstance(d.get("kv_lora_rank"), int) and heads:  # MLA: as many kv heads as heads
        for k in KV_HEADS:
            if isinstance(d.get(k), int):
                d[k] = heads
    if isinstance(d.get("qk_rope_head_dim"), int) and isinstance(d.get("head_dim"), int):
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA models rotate head_dim = qk_rope_head_dim channels
    return d


def _changes(orig, new):
    """Only what the shrink changed: defaults computed from other fields are computed again."""
    out = {}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(orig.get(k), dict) and k not in ("id2label", "label2id"):
            sub = _changes(orig[k], v)
            if sub:
                out[k] = sub
        elif orig.get(k, object()) != v:
            out[k] = v
    return out


def _set_path(d, path, value):
    *parents, last = path.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


# The task heads a type may have, by the suffix of its spec (TYPE/qa), and the auto mapping that lists them.
TASK_HEADS = {"seqcls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
         "tokcls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
         "qa": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
         "mc": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"}
HEAD_LABELS = 3  # classes of the /seqcls and /tokcls heads


def model_class(model_type, want=None):
    """(class, which) for a model type: seq2seq before causal before masked unless `want` says (a task
    head of TASK_HEADS only when asked for)."""
    import transformers
    from transformers.models.auto import modeling_auto as ma

    maps = [("seq2seq", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
            ("causal", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
            ("mlm", ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES)]
    if want in TASK_HEADS:
        maps = [(want, getattr(ma, TASK_HEADS[want]))]
    for which, mapping in maps:
        if (want is None or want == which) and model_type in mapping:
            name = mapping[model_type]
            if isinstance(name, (list, tuple)):
                name = name[0]
            return getattr(transformers, name), which
    raise KeyError(f"{model_type}: no {want or 'LM'} class")


def tiny_config(model_type, which):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    if model_type == "encoder-decoder":
        from transformers import BertConfig, EncoderDecoderConfig

        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     vocab_size=VOCAB)
        enc = BertConfig(**small)
        dec = BertConfig(**small, is_decoder=True, add_cross_attention=True)
        config = EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
        config.decoder_start_token_id, config.pad_token_id = 101 % VOCAB, 0
        return config
    import copy

    orig = config_class().to_dict()
    d = shrink(copy.deepcopy(orig))
    for key, value in OVERRIDES.get(model_type, {}).items():
        _set_path(d, key, value)
    d = _changes(orig, d)
    if which == "causal" and not orig.get("is_encoder_decoder") and "is_decoder" in orig:
        d["is_decoder"] = True  # BertLMHeadModel & co. are causal only with it, as their docs say
    if which in ("seqcls", "tokcls"):
        d["num_labels"] = HEAD_LABELS
    config = config_class(**d)
    if which in TASK_HEADS:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "pad_token_id", None) is None:
            # a decoder's head pools the last real token by the pad id: users set it to EOS, as for GPT-2
            # (the vocabulary's last id where the config names no EOS either)
            eos = getattr(text, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) and eos else eos
            config.pad_token_id = text.pad_token_id = eos if isinstance(eos, int) else text.vocab_size - 1
        if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
            config.decoder_start_token_id = config.pad_token_id  # T5's checkpoints start the decoder at pad
    return config


def build_model(spec):
    """spec: TYPE, TYPE@bf16 or TYPE/mlm (the masked-LM class of a type whose main class is another)."""
    import torch

    dtype = None
    if "@" in spec:
        spec, dt = spec.split("@")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    want = None
    if "/" in spec:
        spec, want = spec.split("/")
    cls, which = model_class(spec, want)
    config = tiny_config(spec, which)
    torch.manual_seed(0)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if not isinstance(config, cls.config_class) and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)  # a composite config: the LM class takes its text part
    model = cls._from_config(config, **kwargs)
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):
        model.set_default_language(config.languages[0])  # X-MOD: the adapter its users pick first
    return model.eval()


def build():
    return build_model(os.environ["HF_SWEEP_TYPE"])
