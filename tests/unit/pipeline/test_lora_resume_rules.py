"""Which checkpoints a LoRA (or full fine-tune) run may resume from or export: raytrain.pipeline.lora's rules."""

import pytest
import torch
from safetensors.torch import save_file

from raytrain.config import load_job_config
from raytrain.errors import RaytrainError
from raytrain.pipeline.lora import base_identity, check_resume_settings

DEMO = "configs/demo.yaml"


def _saved(job) -> dict:
    """What a checkpoint records of the job that wrote it (its config as JSON has it: tuples become lists)."""
    tree = job.to_dict()
    tree["model"]["lora"]["targets"] = list(tree["model"]["lora"]["targets"])
    return tree


def test_full_fine_tune_resumes_a_full_fine_tune():
    job = load_job_config(DEMO)
    check_resume_settings(_saved(job), None, job, {}, "ckpt")


def test_same_lora_settings_on_the_same_base_resume():
    job = load_job_config(DEMO, ["model.lora.rank=4"])
    check_resume_settings(_saved(job), base_identity(job), job, base_identity(job), "ckpt")


@pytest.mark.parametrize("saved,now", [((), ("model.lora.rank=4",)), (("model.lora.rank=4",), ()),
                                       (("model.lora.rank=4",), ("model.lora.rank=4", "model.lora.alpha=4")),
                                       (("model.lora.rank=4",), ("model.lora.rank=4", "model.lora.targets=[q_proj]"))])
def test_other_lora_settings_are_refused_naming_both(saved, now):
    before, after = load_job_config(DEMO, list(saved)), load_job_config(DEMO, list(now))
    with pytest.raises(RaytrainError, match=r"ckpt was trained with model\.lora \{.*\}, this config has \{.*\}"):
        check_resume_settings(_saved(before), base_identity(before) if before.model.lora.rank else None, after,
                              base_identity(after) if after.model.lora.rank else {}, "ckpt")


def test_another_base_is_refused_naming_both(tmp_path):
    for name, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.full((2,), value)}, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text("{}")
    a = load_job_config(DEMO, ["model.lora.rank=4", f"model.init_from={tmp_path / 'a'}"])
    b = load_job_config(DEMO, ["model.lora.rank=4", f"model.init_from={tmp_path / 'b'}"])
    ident_a, ident_b = base_identity(a), base_identity(b)
    assert ident_a["weights_sha256"] != ident_b["weights_sha256"] and len(ident_a["weights_sha256"]) == 64
    with pytest.raises(RaytrainError, match=r"trained on the base \{'init_from': '.*/a', 'weights_sha256': '[0-9a-f]{64}'"
                                            r"\}; this config's base is \{'init_from': '.*/b'"):
        check_resume_settings(_saved(a), ident_a, b, ident_b, "ckpt")
    # the same folder with other bytes (a base overwritten in place) is another base too
    save_file({"w": torch.full((2,), 3.0)}, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(RaytrainError, match="trained on the base"):
        check_resume_settings(_saved(a), ident_a, a, base_identity(a), "ckpt")


def test_a_seeded_base_is_named_by_preset_and_seed():
    job = load_job_config(DEMO, ["model.lora.rank=4", "train.seed=7"])
    assert base_identity(job) == {"preset": "tiny", "seed": 7}
