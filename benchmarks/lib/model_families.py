"""Small random checkpoints of every model family the engine serves, written with
transformers (``gpu/gpu_graph_families.py`` serves each one; ``gpu/gpu_graph_features.py``
the Llama one), with the word-level tokenizer of ``random_checkpoints``."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lib.random_checkpoints import EOS_ID, save_random_model

WINDOW = 128  # the sliding layers' window: shorter than the longest prompts
COMMON = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.05,
              bos_token_id=1, eos_token_id=EOS_ID, tie_word_embeddings=False)
SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2)
# family -> (transformers config class, model class, config fields beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(SLIDING, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    query_pre_attn_scalar=64, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(SLIDING, query_pre_attn_scalar=64, pad_token_id=0,
                    rope_local_base_freq=10000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=512)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                       norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(SLIDING, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=512, swiglu_limit=7.0)),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def write_family(out: Path, family: str, smoke: bool) -> Path:
    """A random ``family`` checkpoint (bf16 on a GPU) with the word-level tokenizer."""
    import transformers
    config_class, model_class, extra = FAMILIES[family]
    fields = dict(COMMON, **extra)
    if smoke:
        fields.update(TINY, max_position_embeddings=512)
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:2]
        if "intermediate_size" in extra:
            fields["intermediate_size"] = 64
    config = getattr(transformers, config_class)(**fields)
    return save_random_model(out, getattr(transformers, model_class), config)
