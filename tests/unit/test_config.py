import dataclasses
import re

import pytest

from raytrain.config import JobConfig, PlainScalar, load_job_config, parse_override
from raytrain.errors import ConfigError

DEMO = "configs/demo.yaml"


def test_demo_config_loads_and_matches_its_yaml():
    cfg = load_job_config(DEMO)
    assert cfg.train.pp == 2 and cfg.train.dp == 1
    assert cfg.model.preset == "tiny"
    assert cfg.input.path == "sample"
    assert cfg.enrich.eval_sets == ("sample",)
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.train.dp


def test_dotted_overrides_are_typed():
    cfg = load_job_config(DEMO, ["train.max_steps=20", "train.lr=3e-4", "train.use_gpu=true",
                                 "input.splits=[chat, math]", "storage.run_name=exp1"])
    assert cfg.train.max_steps == 20 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.use_gpu is True
    assert cfg.input.splits == ("chat", "math")
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
    ("input.splits=[chat, poetry]", "input.splits"),
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
    assert parse_override("a.b=1") == ("a.b", PlainScalar("1", "tag:yaml.org,2002:int"))
    assert parse_override("a.b=x") == ("a.b", "x") and parse_override("a.b=") == ("a.b", "")
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
    for override in ("enrich.top_k=5", "dataset.seq_len=64", "input.splits=[chat]"):
        assert load_job_config(DEMO, [override]).data_hash() != a.data_hash(), override
    for override in ("train.lr=0.1", "model.attn_impl=segment", "storage.run_name=other"):
        assert load_job_config(DEMO, [override]).data_hash() == a.data_hash(), override


# ---- typed values: what a field gets from what was typed ----------------------------------------------------------
def _lead0(field, text):
    return (f"{field}: '{text}' starts with 0, which YAML 1.1 reads as octal (010 = 8) and other tools as decimal; "
            "write the number without leading zeros")


def _not_int(field, text):
    return f"{field}: expected a whole number in decimal digits (e.g. 10), got '{text}'"


def _not_float(field, text):
    return f"{field}: expected a number (e.g. 0.5 or 3e-4), got '{text}'"


def _not_finite(field, text):
    return f"{field}: must be a finite number, got '{text}'"


STR_F, INT_F, FLOAT_F = "storage.run_name", "train.seed", "train.peak_tflops"
TYPED = [  # (typed, storage.run_name (str), train.seed (int), train.peak_tflops (float)); a str = the exact error
    ("010", "010", _lead0(INT_F, "010"), _lead0(FLOAT_F, "010")),
    ("0x1F", "0x1F", _not_int(INT_F, "0x1F"), _not_float(FLOAT_F, "0x1F")),
    ("1_000", "1_000", 1000, 1000.0),
    ("nan", "nan", _not_int(INT_F, "nan"), _not_finite(FLOAT_F, "nan")),
    ("inf", "inf", _not_int(INT_F, "inf"), _not_finite(FLOAT_F, "inf")),
    (".inf", f"{STR_F}: '.inf' is not a valid name: use 1-64 letters, digits, '.', '_' or '-', not starting with '.' "
             "(e.g. my-run-01)", _not_int(INT_F, ".inf"), _not_finite(FLOAT_F, ".inf")),
    ("-1", "-1", f"{INT_F}: must be >= 0 (numpy's generators take no negative seed)", f"{FLOAT_F}: must be >= 0 (0 = no MFU)"),
    ("1e309", "1e309", _not_int(INT_F, "1e309"), f"{FLOAT_F}: '1e309' is out of range (overflows to inf)"),
    ("0777", "0777", _lead0(INT_F, "0777"), _lead0(FLOAT_F, "0777")),
    ('"1e3"', "1e3", _not_int(INT_F, "1e3"), 1000.0),
    ("1e3", "1e3", _not_int(INT_F, "1e3"), 1000.0),
    ("3.0e-3", "3.0e-3", _not_int(INT_F, "3.0e-3"), 0.003),
    ("true", "true", _not_int(INT_F, "true"), _not_float(FLOAT_F, "true")),
    ("2024-01-01", "2024-01-01", _not_int(INT_F, "2024-01-01"), _not_float(FLOAT_F, "2024-01-01")),
    ("9223372036854775808", "9223372036854775808", f"{INT_F}: 9223372036854775808 is out of range (at most 2**63 - 1 in "
                                                    "size)", 9.223372036854776e18),
]


def _load_one(how, tmp_path, field, typed):
    """(value, None) or (None, error message) for one field typed in a YAML file or on the command line."""
    section, name = field.split(".")
    path, overrides = None, [f"{field}={typed}"]
    if how == "yaml":
        path, overrides = str(tmp_path / "job.yaml"), []
        (tmp_path / "job.yaml").write_text(f"{section}:\n  {name}: {typed}\n")
    try:
        return getattr(getattr(load_job_config(path, overrides), section), name), None
    except ConfigError as e:
        return None, str(e)


@pytest.mark.parametrize("how", ["yaml", "cli"])
@pytest.mark.parametrize("row", TYPED, ids=[r[0] for r in TYPED])
def test_typed_values_table(how, row, tmp_path):
    typed, *expected = row
    for field, want in zip((STR_F, INT_F, FLOAT_F), expected, strict=True):
        value, error = _load_one(how, tmp_path, field, typed)
        if isinstance(want, str) and want.startswith(field + ":"):
            assert (value, error) == (None, want)
        else:
            assert error is None and value == want and type(value) is type(want), (field, typed, value, error)


@pytest.mark.parametrize("how", ["yaml", "cli"])
def test_bools_are_true_or_false_only(how, tmp_path):
    for typed, want in (("true", True), ("false", False), ("True", True), ("FALSE", False)):
        assert _load_one(how, tmp_path, "train.shuffle", typed) == (want, None)
    for typed in ("yes", "no", "on", "off", "1", "0"):
        assert _load_one(how, tmp_path, "train.shuffle", typed) == (
            None, f"train.shuffle: expected true or false, got '{typed}' (YAML 1.1 and 1.2 read yes/no/on/off "
                  "differently)")
    assert _load_one(how, tmp_path, "train.shuffle", "maybe")[1] == "train.shuffle: expected true or false, got 'maybe'"


def test_texts_keep_what_was_typed_everywhere(tmp_path):
    """Every string field, list items included: the issue's examples, from a file and from the command line."""
    (tmp_path / "job.yaml").write_text("storage:\n  user: 0777\n  project: 0x1F\n  run_name: 010\n"
                                       "enrich:\n  eval_sets: [010, yes, 1.50]\ntrain:\n  keep_best: 1e3\n")
    for job in (load_job_config(str(tmp_path / "job.yaml")),
                load_job_config(None, ["storage.user=0777", "storage.project=0x1F", "storage.run_name=010",
                                       "enrich.eval_sets=[010, yes, 1.50]", "train.keep_best=1e3"])):
        assert (job.storage.user, job.storage.project, job.storage.run_name) == ("0777", "0x1F", "010")
        assert job.enrich.eval_sets == ("010", "yes", "1.50") and job.train.keep_best == "1e3"
    with pytest.raises(ConfigError, match=r"storage\.user: no value \(YAML null\)"):
        load_job_config(None, ["storage.user=~"])


def test_shipped_configs_load_unchanged():
    """The text-keeping loader reads every shipped config to the same values as plain yaml.safe_load."""
    import glob

    import yaml

    def same(written, loaded, where: str) -> None:  # every value the file writes, nested sections included
        if isinstance(written, dict):
            for key, value in written.items():
                same(value, loaded[key], f"{where}.{key}")
        else:
            assert (list(loaded) if isinstance(loaded, tuple) else loaded) == written, where

    for path in sorted(glob.glob("configs/*.yaml")):
        with open(path) as f:
            tree = yaml.safe_load(f)
        same(tree, load_job_config(path).to_dict(), path)


@pytest.mark.parametrize("name", ["a", "A-b_c.9", "x" * 64, "-dash", "_u"])
def test_good_names(name):
    job = load_job_config(None, [f"storage.user={name}", f"storage.project={name}", f"storage.run_name={name}"])
    assert (job.storage.user, job.storage.project, job.storage.run_name) == (name, name, name)


@pytest.mark.parametrize("field", ["storage.user", "storage.project", "storage.run_name"])
@pytest.mark.parametrize("name", [".hidden", "..", "x" * 65, "a/b", "a b", "é", "a:b", '""'])
def test_bad_names_name_the_field(field, name):
    if field == "storage.user" and name == '""':  # an empty user means: from the environment
        assert load_job_config(None, [f"{field}={name}"]).storage.user == ""
        return
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}: .* is not a valid name: use 1-64 "):
        load_job_config(None, [f"{field}={name}"])


@pytest.mark.parametrize("override,message", [
    ("enrich.min_score=1.5", "enrich.min_score: must be in [-1, 1]"),
    ("enrich.min_score=-1.01", "enrich.min_score: must be in [-1, 1]"),
    ("enrich.min_score=.nan", "enrich.min_score: must be a finite number"),
    ("train.lr=0", "train.lr: must be in (0, 1]"),
    ("train.lr=-3e-4", "train.lr: must be in (0, 1]"),
    ("train.lr=3e3", "train.lr: must be in (0, 1]"),
    ("train.lr=inf", "train.lr: must be a finite number"),
    ("train.weight_decay=-0.1", "train.weight_decay: must be >= 0"),
    ("train.grad_clip=-1", "train.grad_clip: must be >= 0"),
    ("train.activation_checkpoint_interval=-1", "train.activation_checkpoint_interval: must be >= 0"),
    ("train.worker_cpus=nan", "train.worker_cpus: must be a finite number"),
    ("ray.num_cpus=-2", "ray.num_cpus: must be >= 0"),
    ("enrich.executor_memory=lots", "enrich.executor_memory: 'lots': write a JVM size"),
    ("dataset.split_weights=[math=inf]", "dataset.split_weights: 'math=inf'"),
    ("dataset.split_weights=[math=nan]", "dataset.split_weights: 'math=nan'"),
    ("input.max_rows=99999999999999999999", "input.max_rows: 99999999999999999999 is out of range"),
    ("train.max_steps=1" + "0" * 5000, "train.max_steps: '1000"),
])
def test_out_of_range_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_job_config(None, [override])
    assert str(err.value).startswith(message), str(err.value)
    for ok in ("enrich.min_score=-1", "enrich.min_score=1", "train.lr=1", "train.weight_decay=0",
               "enrich.executor_memory=512m", "enrich.executor_memory=4G", "dataset.split_weights=[math=2.5]"):
        load_job_config(None, [ok])


def test_the_renamed_validation_metric_is_named_when_keep_best_uses_the_old_one():
    with pytest.raises(ConfigError, match=r"train\.keep_best: the metric 'eval_loss' is now 'validation_loss'"):
        load_job_config(DEMO, ["train.keep_best=eval_loss"])
    assert load_job_config(DEMO, ["train.keep_best=validation_loss"]).train.keep_best == \
        "validation_loss"


@pytest.mark.parametrize("override,message", [
    ("model.lora.rank=-1", r"model\.lora\.rank: -1: must be >= 0 \(0 = off\)"),
    ("model.lora.alpha=0", r"model\.lora\.alpha: 0\.0: must be > 0"),
    ("model.lora.dropout=1", r"model\.lora\.dropout: 1\.0: must be in \[0, 1\)"),
    ("model.lora.dropout=-0.1", r"model\.lora\.dropout: -0\.1: must be in \[0, 1\)"),
    ("model.lora.targets=[q_proj,qkv_proj]", r"model\.lora\.targets: unknown module name\(s\) \['qkv_proj'\]: "
                                             r"choose from \['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', "
                                             r"'up_proj', 'down_proj'\]"),
    ("model.lora.targets=[q_proj,q_proj]", r"model\.lora\.targets: .* name each projection once"),
])
def test_lora_settings_are_checked_naming_the_field_and_valid_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(DEMO, [override])


def test_lora_is_off_by_default_on_all_seven_projections():
    lora = load_job_config(DEMO).model.lora
    assert lora.rank == 0 and lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")
    assert load_job_config(DEMO, ["model.lora.rank=8", "model.lora.targets=[q_proj,v_proj]"]).model.lora.targets == \
        ("q_proj", "v_proj")


@pytest.mark.parametrize(("override", "old", "new"), [
    ("data.input_path=/mnt/x", "data", "input"),
    ("train.sample_new_tokens=8", "train.sample_new_tokens", "train.generation_tokens"),
])
def test_a_renamed_key_gets_an_error_naming_its_new_name(override, old, new):
    with pytest.raises(ConfigError, match=rf"config key '{re.escape(old)}' is now '{re.escape(new)}'"):
        load_job_config(DEMO, [override])


def test_a_config_file_with_the_old_data_section_is_refused_with_the_new_name(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("data:\n  input_path: sample\n")
    with pytest.raises(ConfigError, match=r"config key 'data' is now 'input'"):
        load_job_config(str(path))


def test_data_hash_did_not_change_with_the_rename_of_data_to_input():
    """Runs made before `data:` became `input:` keep their enriched and packed data: their manifests record this
    hash, computed by the version before the rename (commit 78c03b2) for configs/demo.yaml (in one wave, as the demo
    was then; enrich.wave_rows's default -1 is not hashed either)."""
    for waves in ("0", "-1"):
        assert load_job_config(DEMO, [f"enrich.wave_rows={waves}"]).data_hash() == "ab1427144956fd99"
    assert load_job_config(DEMO).data_hash() != "ab1427144956fd99"  # the demo streams: its waves are hashed
    assert load_job_config(DEMO, ["input.path=/mnt/x"]).data_hash() != "ab1427144956fd99"


def test_preference_pairs_refuse_the_split_length_policy():
    with pytest.raises(ConfigError, match=r"^dataset\.length_policy: 'split' cannot apply to preference pairs .*"
                                          r"choose 'drop' or 'truncate'; a pair's two sequences share one pack"):
        load_job_config("configs/demo-dpo.yaml", ["dataset.length_policy=split"])
    for policy in ("drop", "truncate"):
        assert load_job_config("configs/demo-dpo.yaml", [f"dataset.length_policy={policy}"]).dataset.length_policy \
            == policy
    assert load_job_config(DEMO, ["dataset.length_policy=split"]).dataset.length_policy == "split"  # the fine-tune


def test_pair_context_is_for_preference_pairs_only():
    with pytest.raises(ConfigError, match=r"^enrich\.pair_context: selects context for preference pairs only"):
        load_job_config(DEMO, ["enrich.pair_context=true"])
    job = load_job_config("configs/demo-dpo.yaml", ["enrich.pair_context=true"])
    assert job.enrich.pair_context and job.data_hash() != load_job_config("configs/demo-dpo.yaml", []).data_hash()


def test_corpus_context_on_pairs_needs_pair_context_and_real_files():
    with pytest.raises(ConfigError, match=r"^enrich\.context_corpus: preference pairs .* only with "
                                          r"enrich\.pair_context=true"):
        load_job_config("configs/demo-dpo.yaml", ["enrich.context_corpus=[/data/corpus.jsonl]"])
    with pytest.raises(ConfigError, match=r"^enrich\.context_corpus: 'sample' is the fine-tune sample's corpus"):
        load_job_config("configs/demo-dpo.yaml", ["enrich.context_corpus=[sample]", "enrich.pair_context=true"])
    job = load_job_config("configs/demo-dpo.yaml", ["enrich.context_corpus=[/data/corpus.jsonl]",
                                                    "enrich.pair_context=true"])
    assert job.enrich.context_corpus == ("/data/corpus.jsonl",)
