import dataclasses

import pytest

from raytrain.config import JobConfig, load_job_config, parse_override
from raytrain.errors import ConfigError

DEMO = "configs/demo.yaml"


def test_demo_config_loads_and_matches_its_yaml():
    cfg = load_job_config(DEMO)
    assert cfg.train.pp == 2 and cfg.train.dp == 1
    assert cfg.model.preset == "tiny"
    assert cfg.data.input_path == "sample"
    assert cfg.enrich.eval_sets == ("sample",)
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.train.dp


def test_dotted_overrides_are_typed():
    cfg = load_job_config(DEMO, ["train.max_steps=20", "train.lr=3e-4", "train.use_gpu=true",
                                 "data.splits=[chat, math]", "storage.run_name=exp1"])
    assert cfg.train.max_steps == 20 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.use_gpu is True
    assert cfg.data.splits == ("chat", "math")
    assert cfg.storage.run_name == "exp1"


def test_attn_impl_choices():
    assert load_job_config(DEMO).model.attn_impl == "dense"
    assert load_job_config(DEMO, ["model.attn_impl=segment"]).model.attn_impl == "segment"
    assert load_job_config(DEMO, ["model.attn_impl=flex", "train.use_gpu=true"]).model.attn_impl == "flex"
    for gpu_config in ("configs/mistral7b-1node-8gpu.yaml", "configs/mistral7b-2node-16gpu.yaml"):
        assert load_job_config(gpu_config).model.attn_impl == "segment"


def test_config_is_frozen():
    cfg = load_job_config(DEMO)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 3  # type: ignore[misc]


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_step'.*Did you mean train.max_steps"):
        load_job_config(DEMO, ["train.max_step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'"):
        load_job_config(None, ["trian.lr=1"])


@pytest.mark.parametrize("override,field", [
    ("train.max_steps=abc", "train.max_steps"),
    ("train.pp=0", "train.pp"),
    ("train.use_gpu=maybe", "train.use_gpu"),
    ("dataset.tokenizer=v9", "dataset.tokenizer"),
    ("data.splits=[chat, poetry]", "data.splits"),
    ("storage.run_name=../escape", "storage.run_name"),
    ("enrich.question_weight=1.5", "enrich.question_weight"),
    ("train.lr=true", "train.lr"),
    ("model.attn_impl=sparse", "model.attn_impl"),
    ("model.attn_impl=flex", "model.attn_impl"),  # flex without train.use_gpu: torch has no CPU backward
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job_config(DEMO, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_job_config(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_job_config(str(broken))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_job_config(str(scalar))
    section = tmp_path / "section.yaml"
    section.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        load_job_config(str(section))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError):
        load_job_config(str(binary))


def test_override_syntax():
    assert parse_override("a.b=1") == ("a.b", 1)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("train.lr")


def test_config_hash_is_stable_and_sensitive():
    a = load_job_config(DEMO)
    assert a.config_hash() == load_job_config(DEMO).config_hash()
    assert a.config_hash() != load_job_config(DEMO, ["train.lr=1e-4"]).config_hash()
    assert JobConfig().config_hash()


def test_tracking_and_shuffle_settings_are_checked():
    job = load_job_config(None, ["train.tracking=[mlflow, wandb]", "train.shuffle=false"])
    assert job.train.tracking == ("mlflow", "wandb") and job.train.shuffle is False
    assert job.flat_dict()["train.tracking"] == ["mlflow", "wandb"]
    with pytest.raises(ConfigError, match="train.tracking.*'tensorboard'"):
        load_job_config(None, ["train.tracking=[tensorboard]"])
    with pytest.raises(ConfigError, match="train.wandb_mode"):
        load_job_config(None, ["train.wandb_mode=cloud"])


def test_data_hash_follows_only_the_sections_that_decide_the_data():
    a = load_job_config(DEMO)
    assert a.data_hash() == load_job_config(DEMO).data_hash()
    for override in ("enrich.top_k=5", "dataset.seq_len=64", "data.splits=[chat]"):
        assert load_job_config(DEMO, [override]).data_hash() != a.data_hash(), override
    for override in ("train.lr=0.1", "model.attn_impl=segment", "storage.run_name=other"):
        assert load_job_config(DEMO, [override]).data_hash() == a.data_hash(), override
