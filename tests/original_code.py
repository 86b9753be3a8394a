"""Stand-ins for the ORIGINAL configuration_chatglm.py files, for the "copy modeling_chatglm.py alone" workflow.

Written for these tests from the facts of the originals (their field names and defaults; the class stores each field,
sets `vocab_size = padded_vocab_size`, validates nothing and defines no aliases or helper methods): what a user's
downloaded glm-4-9b-chat or chatglm3-6b folder keeps beside a copied modeling_chatglm.py.
"""

# Fields and defaults shared by both families, in the originals' order.
_COMMON_FIELDS = """\
        num_layers=28,
        padded_vocab_size=65024,
        hidden_size=4096,
        ffn_hidden_size=13696,
        kv_channels=128,
        num_attention_heads=32,
        seq_length=2048,
        hidden_dropout=0.0,
        classifier_dropout=None,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        rmsnorm=True,
        apply_residual_connection_post_layernorm=False,
        post_layer_norm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_dropout_fusion=True,
        multi_query_attention=False,
        multi_query_group_num=1,
        apply_query_key_layer_scaling=True,
        attention_softmax_in_fp32=True,
        fp32_residual_connection=False,
"""
# GLM-4's class reads rope_ratio (chatglm3-6b's has no such field); ChatGLM3's carries the cpm_kernels
# quantization and P-tuning v2 fields.
_GLM4_FIELDS = """\
        rope_ratio=1,
"""
_CHATGLM3_FIELDS = """\
        quantization_bit=0,
        pre_seq_len=None,
        prefix_projection=False,
"""


def original_configuration_source(family: str) -> str:
    fields = _COMMON_FIELDS + (_CHATGLM3_FIELDS if family == "chatglm3" else _GLM4_FIELDS)
    names = [line.strip().split("=")[0] for line in fields.splitlines()]
    assignments = "\n".join(f"        self.{name} = {name}" for name in names)
    return (
        "from transformers import PretrainedConfig\n\n\n"
        "class ChatGLMConfig(PretrainedConfig):\n"
        '    model_type = "chatglm"\n\n'
        f"    def __init__(\n        self,\n{fields}        **kwargs\n    ):\n"
        f"        self.vocab_size = padded_vocab_size\n{assignments}\n"
        "        super().__init__(**kwargs)\n"
    )
