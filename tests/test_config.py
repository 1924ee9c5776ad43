"""ModelConfig: derived sizes, validation messages, serialisation, presets."""

import pytest

from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.presets import PRESETS, get_preset


def test_defaults_and_derived_sizes():
    cfg = ModelConfig(dim=4096, n_heads=32, mlp="swiglu", multiple_of=256)
    assert cfg.n_kv_heads is None and cfg.kv_heads == 32 and cfg.head_size == 128
    assert cfg.ffn_dim == 11008  # LLaMA: int(2 * 4 * 4096 / 3) = 10922, rounded up to 256
    assert ModelConfig(dim=768, n_heads=12, mlp="gelu").ffn_dim == 3072
    assert ModelConfig(dim=64, n_heads=4, head_dim=32).head_size == 32


def test_invalid_config_lists_every_problem():
    with pytest.raises(ConfigError) as e:
        ModelConfig(n_heads=8, n_kv_heads=3, pos_encoding="rotary", norm="batchnorm", dropout=1.5)
    msg = str(e.value)
    assert "n_heads=8 is not divisible by n_kv_heads=3" in msg
    assert "pos_encoding='rotary' is not one of learned, sinusoidal, rope, alibi, none" in msg
    assert "norm='batchnorm' is not one of layernorm, rmsnorm" in msg
    assert "dropout=1.5 must be in [0, 1)" in msg
    assert len(e.value.problems) == 4


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(mlp="swish"), "mlp='swish' is not one of gelu, relu, swiglu, geglu"),
        (dict(multiple_of=True), "multiple_of=True must be a positive integer"),
        (dict(attn_impl="flash"), "attn_impl='flash' is not one of sdpa, manual"),
        (dict(norm_position="middle"), "norm_position='middle' is not one of pre, post"),
        (dict(dim=100, n_heads=8, n_kv_heads=8), "dim=100 is not divisible by n_heads=8"),
        (dict(parallel_block=True, norm_position="post"), "parallel_block=True needs"),
        (dict(pos_encoding="alibi", rope_scaling="linear"), "rope_scaling='linear' needs"),
        (dict(dim=0), "dim=0 must be a positive integer"),
        (dict(sliding_window=0), "sliding_window=0 must be a positive integer or null"),
        (dict(rope_factor=0.5), "rope_factor=0.5 must be a number >= 1.0"),
        (dict(qk_norm=True, norm="layernorm"), "qk_norm=True is implemented with RMSNorm"),
    ],
)
def test_each_message(changes, expected):
    with pytest.raises(ConfigError, match=None) as e:
        ModelConfig(**changes)
    assert expected in str(e.value)


def test_unknown_key_is_rejected_with_suggestion():
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({"n_layer": 4})
    assert "unknown field 'n_layer' (did you mean 'n_layers'?)" in str(e.value)


def test_both_configs_refuse_unknown_keys_alike():
    """One check of unknown keys (config.from_fields) for ModelConfig and TrainConfig: every
    unknown key named, sorted, with the field it may mean, under the class's name."""
    from llm_foundry.train.config import TrainConfig

    for cls, keys, hint in (
        (ModelConfig, {"n_layer": 4, "zz": 1}, "n_layers"),
        (TrainConfig, {"max_step": 3, "zz": 1}, "max_steps"),
    ):
        with pytest.raises(ConfigError) as e:
            cls.from_dict(keys)
        assert str(e.value) == (
            f"invalid {cls.__name__} (2 problem(s)):\n  - unknown field {sorted(keys)[0]!r} "
            f"(did you mean {hint!r}?)\n  - unknown field 'zz'"
        )


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_round_trip_files(tmp_path, suffix):
    cfg = get_preset("qwen3-8b")
    path = tmp_path / f"cfg{suffix}"
    cfg.save(path)
    assert ModelConfig.load(path) == cfg


def test_load_accepts_model_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  dim: 128\n  n_heads: 4\ntrain:\n  lr: 0.001\n")
    assert ModelConfig.load(path) == ModelConfig(dim=128, n_heads=4)


def test_presets_are_valid_data():
    for name in PRESETS:
        cfg = get_preset(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert get_preset("falcon-7b").n_kv_heads == 1  # multi-query
    assert get_preset("mistral-7b").sliding_window == 4096
    with pytest.raises(KeyError, match="available presets: gpt2"):
        get_preset("gpt-2")


def test_changing_n_heads_keeps_mha_mha_and_gqa_gqa(capsys):
    import json

    from llm_foundry.cli import main

    gpt2 = get_preset("gpt2")  # MHA: 12 query heads, n_kv_heads not given
    assert gpt2.n_kv_heads is None and gpt2.kv_heads == 12
    assert gpt2.replace(n_heads=8).kv_heads == 8
    assert gpt2.replace(n_heads=24, n_kv_heads=12).kv_heads == 12
    gqa = get_preset("llama-shakespeare").replace(n_kv_heads=2)
    assert gqa.replace(n_heads=8).kv_heads == 2  # an explicit GQA count stays
    for argv, kv in (
        (["--preset", "gpt2", "--model.n_heads", "8"], 8),
        (["--preset", "gpt2", "--model.n_heads", "24", "--model.n_kv_heads", "12"], 12),
        (["--model.n_heads", "4"], 4),  # the default config
    ):
        assert main(["params", *argv, "--json"]) == 0
        saved = json.loads(capsys.readouterr().out)["config"]
        assert ModelConfig.from_dict(saved).kv_heads == kv


def test_a_model_section_that_is_not_a_mapping_is_refused(tmp_path, capsys):
    from llm_foundry.cli import main

    (tmp_path / "c.yaml").write_text("model: [1, 2]\n")
    assert main(["params", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "the model section must be a mapping of fields, got [1, 2]" in capsys.readouterr().err


def test_one_config_file_serves_every_command(tmp_path, capsys):
    import json

    from llm_foundry.cli import main
    from llm_foundry.cli.inspect import main as inspect_main

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  dim: 64\n  n_heads: 4\ntrain:\n  max_steps: 5\n")
    assert main(["params", "--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["dim"] == 64
    assert (
        inspect_main(["lr", "--config", str(cfg), "--out", str(tmp_path / "lr.png"), "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["train"]["max_steps"] == 5


def test_tensor_parallel_refusals_name_the_field_and_the_way_out():
    from llm_foundry.train.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        TrainConfig(parallel="tp", dtype="fp16", lora_r=4, monitor_interval=5)
    msg = str(e.value)
    assert "dtype='fp16' with parallel='tp'" in msg and "use bf16 or fp32" in msg
    assert "lora_r=4 with parallel='tp'" in msg and "monitor_interval=5 with parallel='tp'" in msg
    assert TrainConfig(parallel="fsdp+tp", tp_size=2, optimizer="muon").tp_size == 2
    with pytest.raises(ConfigError, match="tp_size=2 with parallel='ddp': tp_size applies to"):
        TrainConfig(parallel="ddp", tp_size=2)
    with pytest.raises(ConfigError, match="tp_size=1 with parallel='fsdp\\+tp': one rank"):
        TrainConfig(parallel="fsdp+tp", tp_size=1)


def test_the_tensor_parallel_degree_follows_the_world():
    from llm_foundry.train.distributed import tp_degree

    assert tp_degree("ddp", 0, 4) == 1 and tp_degree("tp", 0, 1) == 1
    assert tp_degree("tp", 0, 4) == 4 and tp_degree("fsdp+tp", 0, 4) == 2
    assert tp_degree("fsdp+tp", 4, 8) == 4
    with pytest.raises(ValueError, match="plain tp uses every rank"):
        tp_degree("tp", 2, 4)
    with pytest.raises(ValueError, match="at least 2 groups of tp_size ranks"):
        tp_degree("fsdp+tp", 2, 2)
    with pytest.raises(ValueError, match="at least 2 groups of tp_size ranks"):
        tp_degree("fsdp+tp", 3, 4)


@pytest.mark.parametrize(
    "changes, expected",
    [
        # a truthy non-bool would silently switch a feature on (or off)
        (dict(tie_embeddings=1), "tie_embeddings=1 must be true or false"),
        (dict(residual="no"), "residual='no' must be true or false"),
        (dict(parallel_block=True, parallel_norms=True), "parallel_norms=True is not one of 1, 2"),
        (dict(dropout=False), "dropout=False must be in [0, 1)"),
        # sizes past 64 bits pass an int check and fail deep inside torch
        (dict(dim=10**30), "dim=1000000000000000000000000000000 is too large: at most 2**63 - 1"),
        (dict(n_layers=2**63), "n_layers=9223372036854775808 is too large: at most 2**63 - 1"),
        (dict(n_experts=2**64), "n_experts=18446744073709551616 is too large: at most 2**63 - 1"),
        # infinite numbers: ffn_dim would raise OverflowError, weights would be inf
        (dict(mlp_ratio=float("inf")), "mlp_ratio=inf must be > 0"),
        (dict(init_std=float("inf")), "init_std=inf must be > 0"),
        (dict(rope_factor=float("nan")), "rope_factor=nan must be a number >= 1.0"),
    ],
)
def test_values_that_would_pass_a_type_check_but_break_later_are_named(changes, expected):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**changes)
    assert e.value.problems == [expected]
    assert str(e.value) == f"invalid ModelConfig (1 problem): {expected}"  # one line


def test_a_long_value_is_shown_cut_with_its_size():
    with pytest.raises(ConfigError) as e:
        ModelConfig(vocab_size=list(range(10_000)))
    (problem,) = e.value.problems
    assert problem.startswith("vocab_size=[0, 1, 2") and "(10,000 items)" in problem
    assert len(problem) < 150


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"data_sampling": "epochs"}, "data_sampling='epochs' is not one of windows, packed"),
        ({"document_mask": "no"}, "document_mask='no' must be true or false"),
        ({"prefetch": -1}, "prefetch=-1 must be a non-negative integer"),
        (
            {"data_sampling": "packed", "sft_packing": True},
            "data_sampling='packed' with sft_packing=true: data_sampling is for text and "
            "sft_packing for fine-tuning rows; set the one your data needs",
        ),
    ],
)
def test_data_sampling_fields_name_the_value_and_what_is_valid(changes, expected):
    from llm_foundry.train.config import TrainConfig

    with pytest.raises(ConfigError) as err:
        TrainConfig(**changes)
    assert err.value.problems == [expected]
    assert TrainConfig(data_sampling="packed", document_mask=False, prefetch=0).prefetch == 0
