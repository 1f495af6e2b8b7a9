import json

import pytest

from decodebench.errors import ConfigError
from decodebench.model import QuantSpec, bundled_model_names, load_model_spec, resolve_model_path


def test_kimi_k25_reads_the_nested_text_config():
    spec = load_model_spec("kimi-k2.5")
    assert spec.architecture == "DeepseekV3ForCausalLM"
    assert (spec.hidden_size, spec.num_layers, spec.num_heads) == (7168, 61, 64)
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim) == (1536, 512, 64)
    assert (spec.num_experts, spec.top_k, spec.moe_intermediate_size) == (384, 8, 2048)
    assert (spec.scoring_func, spec.topk_method, spec.routed_scaling_factor) == ("sigmoid", "noaux_tc", 2.827)
    assert spec.rms_norm_eps == 1e-5
    assert spec.num_moe_layers == 60


def test_kimi_k25_quantization_keeps_attention_and_shared_experts_in_bf16():
    quant = load_model_spec("kimi-k2.5").quant
    assert (quant.method, quant.bits, quant.group_size, quant.symmetric) == ("compressed-tensors", 4, 32, True)
    assert quant.format == "pack-quantized"
    assert quant.is_quantized("model.layers.5.mlp.experts.17.down_proj")
    assert not quant.is_quantized("model.layers.5.self_attn.kv_b_proj")
    assert not quant.is_quantized("model.layers.5.mlp.shared_experts.up_proj")
    assert not quant.is_quantized("model.layers.0.mlp.gate_proj")  # the dense layer 0
    assert not quant.is_quantized("lm_head")
    assert quant.expert_weight_bytes_per_param == 0.5625  # 4 bits + a bf16 scale per 32


def test_deepseek_v3_style_top_level_config():
    spec = load_model_spec("deepseek-v3")
    assert (spec.num_heads, spec.num_experts, spec.num_expert_groups, spec.topk_groups) == (128, 256, 8, 4)
    assert spec.quant == QuantSpec("fp8", bits=8, block_size=(128, 128))
    assert spec.num_moe_layers == 58


def test_model_can_be_a_directory_or_a_file(tmp_path):
    path = resolve_model_path("kimi-k2.5")
    assert resolve_model_path(path) == path
    assert resolve_model_path(path.parent) == path
    assert "kimi-k2.5" in bundled_model_names()


def _write(tmp_path, document) -> str:
    path = tmp_path / "config.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


def _kimi_text(tmp_path):
    return json.loads(resolve_model_path("kimi-k2.5").read_text())


def test_missing_field_is_named(tmp_path):
    raw = _kimi_text(tmp_path)
    del raw["text_config"]["kv_lora_rank"]
    with pytest.raises(ConfigError, match="text_config lacks required field.*kv_lora_rank"):
        load_model_spec(_write(tmp_path, raw))


def test_malformed_json_names_the_file(tmp_path):
    path = _write(tmp_path, '{"hidden_size": 7168,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_spec(path)


def test_wrong_type_is_named(tmp_path):
    raw = _kimi_text(tmp_path)
    raw["text_config"]["num_experts_per_tok"] = "eight"
    with pytest.raises(ConfigError, match="'num_experts_per_tok' has an invalid value 'eight'"):
        load_model_spec(_write(tmp_path, raw))


@pytest.mark.parametrize("value", ["long", 0, True])
def test_a_max_position_count_that_is_not_a_positive_integer_is_named(tmp_path, value):
    raw = _kimi_text(tmp_path)
    raw["text_config"]["max_position_embeddings"] = value
    with pytest.raises(ConfigError, match="'max_position_embeddings' has an invalid value"):
        load_model_spec(_write(tmp_path, raw))


def test_the_model_carries_its_longest_context():
    assert load_model_spec("kimi-k2.5").max_positions == 262144


def test_quantization_without_group_size_is_rejected(tmp_path):
    raw = _kimi_text(tmp_path)
    del raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    with pytest.raises(ConfigError, match="group_size"):
        load_model_spec(_write(tmp_path, raw))


def test_unknown_quant_method_is_rejected(tmp_path):
    raw = _kimi_text(tmp_path)
    raw["text_config"]["quantization_config"] = {"quant_method": "gguf"}
    with pytest.raises(ConfigError, match="quant_method 'gguf' is not supported"):
        load_model_spec(_write(tmp_path, raw))


@pytest.mark.parametrize("document", ["[1, 2]", '{"text_config": 3}'])
def test_non_object_configs_are_rejected(tmp_path, document):
    with pytest.raises(ConfigError):
        load_model_spec(_write(tmp_path, document))


def test_unknown_model_lists_the_bundled_ones():
    with pytest.raises(ConfigError, match="kimi-k2.5"):
        load_model_spec("no-such-model")


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_experts_per_tok": 400}, "'num_experts_per_tok' = 400 is larger than 'n_routed_experts' = 384"),
    ({"n_group": 8, "topk_group": 9}, "'topk_group' = 9 is larger than 'n_group' = 8"),
], ids=["experts", "groups"])
def test_a_top_k_over_fewer_choices_is_rejected_naming_both_fields(tmp_path, fields, message):
    # accepted before, it failed four MoE/routing cases with "selected index k out of range"
    raw = _kimi_text(tmp_path)
    raw["text_config"].update(fields)
    with pytest.raises(ConfigError, match=message):
        load_model_spec(_write(tmp_path, raw))
    raw["text_config"]["num_experts_per_tok"] = raw["text_config"]["n_routed_experts"] = 8  # equal is fine
    raw["text_config"]["topk_group"] = raw["text_config"].get("n_group", 1)
    assert load_model_spec(_write(tmp_path, raw)).top_k == 8
