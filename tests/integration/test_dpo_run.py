"""Preference training end to end on CPU: HelpSteer3-shaped pairs packed by Ray Data -> the reference pass through a
2-stage pipeline -> DPO steps in a TorchTrainer -> validation metrics, TensorBoard, checkpoints -> a resumed run.

The pairs skip Spark (the pair enrichment is tested in test_enrich_spark.py): the sample's rows go through the same
row logic and tokenizer in this process and are written as the enrichment writes them, then packed by the runner's
own packing (raytrain.dataset.stream.pack_enriched_pairs) into each run's data folder."""

import gzip
import json
import math
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain.config import load_job_config
from raytrain.dataset.tokenize import load_tokenizer, tokenize_pair
from raytrain.enrich.preference import PreferenceExample, derive_pair
from raytrain.runner import open_run, run_train
from raytrain.sample_data.preference import write_preference_sample

MAX_STEPS = 4


def _job(root, run_name: str, *extra: str):
    return load_job_config("configs/demo-dpo.yaml", [
        f"storage.root={root}", "storage.user=ci", f"storage.run_name={run_name}", f"train.max_steps={MAX_STEPS}",
        "train.checkpoint_every=2", "train.eval_every=2", "train.warmup_steps=0", *extra])


def _write_pairs(job, sample_dir: str) -> None:
    """The sample's pairs as the enrichment writes them (kept rows only), packed into the run's data folder."""
    from raytrain.dataset.stream import pack_enriched_pairs

    tokenizer = load_tokenizer(job.dataset.tokenizer)
    rows = []
    for split in ("train", "validation"):
        with gzip.open(os.path.join(sample_dir, "preference", f"{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
            for line in f:
                pair = derive_pair(json.loads(line))
                if not isinstance(pair, PreferenceExample):
                    continue
                tokens = tokenize_pair(pair.pair_id, pair.prompt, pair.chosen, pair.rejected, tokenizer)
                rows.append({"uuid": pair.pair_id, "split": split, "prompt_ids": list(tokens.prompt),
                             "chosen_ids": list(tokens.chosen), "rejected_ids": list(tokens.rejected),
                             "num_tokens": tokens.num_tokens})
    run = open_run(job)
    enriched = run.paths.enriched
    os.makedirs(enriched.path, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(sorted(rows, key=lambda r: r["uuid"])), os.path.join(enriched.path,
                                                                                         "part-0.parquet"))
    pack_enriched_pairs(enriched, run.paths.packed, job.dataset, job.data_hash())


def _metrics(job) -> dict[int, dict]:
    with open(open_run(job).root.join("reports", "metrics.jsonl").path) as f:
        rows = [json.loads(line) for line in f]
    return {row["step"]: row for row in rows}


def _reference_files(job) -> dict[str, tuple[int, np.ndarray]]:
    folder = open_run(job).paths.data.join("reference").path
    out = {}
    for key in os.listdir(folder):
        for name in os.listdir(os.path.join(folder, key)):
            path = os.path.join(folder, key, name)
            out[name] = (os.stat(path).st_mtime_ns, np.load(path))
    return out


def _digests(job) -> dict[int, dict]:
    reports = open_run(job).root.join("reports").path
    return {rank: json.load(open(os.path.join(reports, f"param_digest_rank{rank}.json")))["digests"] for rank in (0, 1)}


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory):
    """Run a: MAX_STEPS steps in one launch. Run b: the same data, stopped after step 2 and launched again. Run c:
    LoRA, pp 1 x dp 2."""
    root = tmp_path_factory.mktemp("dpo-runs")
    sample = write_preference_sample(str(root / "sample"))
    a, b = _job(root, "a"), _job(root, "b", "train.stop_at_step=2")
    _write_pairs(a, os.path.dirname(os.path.dirname(sample.train_path)))
    shutil.copytree(open_run(a).paths.data.path, open_run(b).paths.data.path)  # same settings: same packs
    summary_a = run_train(a)
    run_train(b)
    first_launch = _reference_files(b)
    summary_b = run_train(_job(root, "b"))
    # c: LoRA on one stage, two replicas: the reference (adapters off) scored by both replicas, metrics over both
    c = _job(root, "c", "train.pp=1", "train.dp=2", "model.lora.rank=4", "model.lora.alpha=8")
    shutil.copytree(open_run(a).paths.data.join("packed").path, open_run(c).paths.packed.path)
    summary_c = run_train(c)
    return {"a": a, "b": _job(root, "b"), "c": c, "summary_a": summary_a, "summary_b": summary_b,
            "summary_c": summary_c, "b_first_launch": first_launch}


def test_first_step_is_ln2_with_zero_rewards(runs):
    """Before any update the policy is the reference: TRL's DPO loss is ln 2 and every reward 0."""
    first = _metrics(runs["a"])[1]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[name] == pytest.approx(0.0, abs=1e-6), name
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    last = _metrics(runs["a"])[MAX_STEPS]
    assert last["loss"] < math.log(2) and last["rewards/margins"] > 0  # training prefers the chosen responses


def test_validation_metrics_tensorboard_and_chart(runs):
    metrics = _metrics(runs["a"])
    for step in (2, MAX_STEPS):
        assert {"validation_loss", "validation/rewards/accuracies", "validation/rewards/margins"} <= set(metrics[step])
    assert "validation_loss" not in metrics[1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = open_run(runs["a"])
    board = EventAccumulator(run.root.join("reports", "tensorboard").path)
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"train/loss", "train/rewards/margins", "train/rewards/accuracies", "validation/rewards/margins",
            "validation/loss"} <= tags
    margins = [e.value for e in board.Scalars("train/rewards/margins")]
    assert margins == pytest.approx([metrics[s]["rewards/margins"] for s in sorted(metrics)], rel=1e-6)
    assert os.path.exists(run.root.join("reports", "charts", "rewards.png").path)


def test_resumed_run_is_bit_equal_and_does_not_score_the_reference_again(runs):
    a, b = _metrics(runs["a"]), _metrics(runs["b"])
    assert [a[s]["loss"] for s in sorted(a)] == [b[s]["loss"] for s in sorted(b)]
    assert [a[s]["rewards/margins"] for s in sorted(a)] == [b[s]["rewards/margins"] for s in sorted(b)]
    assert _digests(runs["a"]) == _digests(runs["b"])
    first, second = runs["b_first_launch"], _reference_files(runs["b"])
    assert set(first) == set(second) == {"train.npy", "validation.npy"}
    for name, (mtime, values) in second.items():
        assert mtime == first[name][0]  # the second launch read them, it did not write them again
        np.testing.assert_array_equal(values, _reference_files(runs["a"])[name][1])  # a scored the same


def test_reference_logps_equal_the_starting_model_outside_the_pipeline(runs):
    """The stored reference of the first training pack equals the seeded starting model's log-probabilities
    computed in this process with the plain layers (no DeepSpeed, no pipeline)."""
    from raytrain.dataset.pack_reader import PackReader
    from raytrain.pipeline.dpo import pair_logps
    from raytrain.pipeline.model import build_sequential, model_config

    job = runs["a"]
    run = open_run(job)
    packed = run.paths.packed
    manifest = json.loads(packed.join("_manifest.json").read_text())
    pack = PackReader(packed.uri, manifest["files"]).read([0])
    model = build_sequential(model_config(job.model.preset), seed=job.train.seed).eval()
    inputs = tuple(torch.from_numpy(pack[name]) for name in ("input_ids", "position_ids", "segment_ids"))
    with torch.no_grad():
        logps, _ = pair_logps(model(inputs), torch.from_numpy(pack["labels"]), inputs[2],
                              torch.from_numpy(pack["pair_segments"]).view(1, -1, 2))
    stored = _reference_files(job)["train.npy"][1][0]
    np.testing.assert_allclose(stored, logps.reshape(-1).numpy(), rtol=1e-5, atol=1e-4)
    assert (stored[:2] < 0).all()  # the first pair slot holds a pair


def test_lora_on_two_replicas_takes_the_base_as_reference(runs):
    """With LoRA the reference is the base (adapters off), which is run a's seeded starting model: the stored
    reference equals a's although c scored it on one stage with two replicas sharing the packs. Its metrics are
    TRL's over both replicas' pairs."""
    reference_a, reference_c = _reference_files(runs["a"]), _reference_files(runs["c"])
    for name in ("train.npy", "validation.npy"):
        np.testing.assert_allclose(reference_c[name][1], reference_a[name][1], rtol=1e-5, atol=1e-4)
    metrics = _metrics(runs["c"])
    assert metrics[1]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # lora_B starts at 0: policy = base
    assert metrics[MAX_STEPS]["rewards/margins"] > 0 and metrics[MAX_STEPS]["loss"] < math.log(2)
    assert "validation/rewards/accuracies" in metrics[MAX_STEPS]
    assert runs["summary_c"]["lora"]["rank"] == 4
