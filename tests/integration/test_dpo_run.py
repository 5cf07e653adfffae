"""Preference training end to end on CPU: HelpSteer3-shaped pairs packed by Ray Data -> the reference pass through a
2-stage pipeline -> DPO steps in a TorchTrainer -> validation metrics, TensorBoard, checkpoints -> a resumed run;
pp 2 x dp 2 against one process, LoRA, and a run starting from another run's weights.

The pairs skip Spark (the pair enrichment is tested in test_enrich_spark.py): the sample's rows go through the same
row logic and tokenizer in this process and are written as the enrichment writes them, then packed by the runner's
own packing (raytrain.dataset.stream.pack_enriched_pairs) into each run's data folder."""

import gzip
import hashlib
import json
import math
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mistral_reference import ours_from_layer_files

from raytrain.config import load_job_config
from raytrain.dataset.tokenize import load_tokenizer, tokenize_pair
from raytrain.enrich.preference import PreferenceExample, derive_pair
from raytrain.runner import open_run, run_train
from raytrain.sample_data.preference import write_preference_sample

MAX_STEPS = 4
PP2_DP2 = ("train.pp=2", "train.dp=2", "train.grad_accum_steps=1")
ONE_PROCESS = ("train.pp=1", "train.dp=1", "train.grad_accum_steps=2",  # the same global batch
               "train.generation_tokens=0")  # run a's generations are enough


def _job(root, run_name: str, *extra: str):
    return load_job_config("configs/demo-dpo.yaml", [
        f"storage.root={root}", "storage.user=ci", f"storage.run_name={run_name}", f"train.max_steps={MAX_STEPS}",
        "train.checkpoint_every=2", "train.eval_every=2", "train.warmup_steps=0",
        "dataset.seq_len=512", *extra])  # half the demo's packs: the same checks at half the cost


PAIRS = {"train": 48, "validation": 4}
"""The first pairs of each split that fit dataset.seq_len: ~45 training packs (4 steps take 16; each launch's
reference pass scores them all) and 4 held out."""


def _write_pairs(job, sample_dir: str) -> None:
    """The sample's first pairs (PAIRS) as the enrichment writes them (kept rows that fit dataset.seq_len), packed
    into the run's data folder."""
    from raytrain.dataset.stream import pack_enriched_pairs

    tokenizer = load_tokenizer(job.dataset.tokenizer)
    rows = []
    for split in ("train", "validation"):
        kept = 0
        with gzip.open(os.path.join(sample_dir, "preference", f"{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
            for line in f:
                pair = derive_pair(json.loads(line))
                if not isinstance(pair, PreferenceExample):
                    continue
                tokens = tokenize_pair(pair.pair_id, pair.prompt, pair.chosen, pair.rejected, tokenizer)
                if tokens.num_tokens > job.dataset.seq_len:
                    continue  # what the enrichment's length policy (drop) quarantines
                rows.append({"uuid": pair.pair_id, "split": split, "prompt_ids": list(tokens.prompt),
                             "chosen_ids": list(tokens.chosen), "rejected_ids": list(tokens.rejected),
                             "num_tokens": tokens.num_tokens})
                kept += 1
                if kept == PAIRS[split]:
                    break
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
    return {rank: json.load(open(os.path.join(reports, f"param_digest_rank{rank}.json")))["digests"]
            for rank in range(job.train.num_workers)}


def _final_weights(job) -> dict[str, torch.Tensor]:
    """The run's last checkpoint as {layer file: {name: tensor}} (DeepSpeed writes one file per layer, any pp)."""
    from raytrain.checkpoint.store import CheckpointStore

    ckpt = CheckpointStore(open_run(job).root).latest()
    folder = os.path.join(ckpt.local_path, "ds")
    return {f"{name}/{k}": v for name in sorted(os.listdir(folder)) if name.startswith("layer_")
            for k, v in torch.load(os.path.join(folder, name), weights_only=True).items()}


@pytest.fixture(scope="module")
def runs(ray_six_cpus, tmp_path_factory):
    """Run a: MAX_STEPS steps, pp 2 x dp 2. Run c: one process (pp 1 x dp 1) on a's global batches. Run b: c
    stopped after step 2 and launched again. Run d: LoRA adapters on a's weights (storage.init_from_run), one
    process. Run e: two steps of the whole model starting from a's weights, one process. All on the same packs."""
    root = tmp_path_factory.mktemp("dpo-runs")
    sample = write_preference_sample(str(root / "sample"))
    a = _job(root, "a", *PP2_DP2)
    _write_pairs(a, os.path.dirname(os.path.dirname(sample.train_path)))
    summary_a = run_train(a)
    c = _job(root, "c", *ONE_PROCESS)
    assert c.train.global_batch_size == a.train.global_batch_size
    b = _job(root, "b", *ONE_PROCESS, "train.stop_at_step=2")
    d = _job(root, "d", *ONE_PROCESS, "model.lora.rank=4", "model.lora.alpha=8",
             f"storage.init_from_run={open_run(a).root.uri}")
    e = _job(root, "e", *ONE_PROCESS, "train.max_steps=2", f"storage.init_from_run={open_run(a).root.uri}")
    for job in (b, c, d, e):  # same data settings: same packs
        shutil.copytree(open_run(a).paths.packed.path, open_run(job).paths.packed.path)
    a_checkpoints = sorted(os.listdir(open_run(a).root.join("checkpoints").path))
    summaries = {name: run_train(job) for name, job in (("c", c), ("b", b), ("d", d), ("e", e))}
    first_launch = _reference_files(b)
    summaries["b"] = run_train(_job(root, "b", *ONE_PROCESS))
    assert sorted(os.listdir(open_run(a).root.join("checkpoints").path)) == a_checkpoints  # e only read a's
    return {"a": a, "b": _job(root, "b", *ONE_PROCESS), "c": c, "d": d, "e": e, "summary_a": summary_a,
            "summary_d": summaries["d"], "b_first_launch": first_launch}


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
    """b (stopped after step 2, launched again) against c (one launch), both one process."""
    c, b = _metrics(runs["c"]), _metrics(runs["b"])
    assert [c[s]["loss"] for s in sorted(c)] == [b[s]["loss"] for s in sorted(b)]
    assert [c[s]["rewards/margins"] for s in sorted(c)] == [b[s]["rewards/margins"] for s in sorted(b)]
    assert _digests(runs["c"]) == _digests(runs["b"])
    first, second = runs["b_first_launch"], _reference_files(runs["b"])
    assert set(first) == set(second) == {"train.npy", "validation.npy"}
    for name, (mtime, values) in second.items():
        assert mtime == first[name][0]  # the second launch read them, it did not write them again
        np.testing.assert_array_equal(values, _reference_files(runs["c"])[name][1])  # c scored the same


def test_reference_logps_equal_the_starting_model_outside_the_pipeline(runs):
    """The stored reference of the first training pack equals the seeded starting model's log-probabilities
    computed in this process with the plain layers (no DeepSpeed, no pipeline)."""
    from raytrain.pipeline.model import build_sequential, model_config

    job = runs["a"]
    model = build_sequential(model_config(job.model.preset), seed=job.train.seed).eval()
    stored = _reference_files(job)["train.npy"][1][0]
    np.testing.assert_allclose(stored, _first_pack_logps(job, model), rtol=1e-5, atol=1e-4)
    assert (stored[:2] < 0).all()  # the first pair slot holds a pair


def test_lora_takes_the_base_as_reference(runs):
    """With LoRA the reference is the base (adapters off): here run a's trained weights, which run e (the whole
    model from a's weights) scored too. The adapters train from there."""
    reference_e, reference_d = _reference_files(runs["e"]), _reference_files(runs["d"])
    for name in ("train.npy", "validation.npy"):
        np.testing.assert_allclose(reference_d[name][1], reference_e[name][1], rtol=1e-5, atol=1e-4)
    metrics = _metrics(runs["d"])
    assert metrics[1]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # lora_B starts at 0: policy = base
    assert metrics[MAX_STEPS]["rewards/margins"] > 0 and metrics[MAX_STEPS]["loss"] < math.log(2)
    assert "validation/rewards/accuracies" in metrics[MAX_STEPS]
    assert runs["summary_d"]["lora"]["rank"] == 4


def test_export_of_lora_from_another_run_has_that_run_as_its_base(runs, tmp_path):
    """`raytrain export` of run d: the base folder holds run a's weights (our layers from a's checkpoint give its
    logits), the adapter folder's base_model_name_or_path names it, and peft's base + adapter give the merged
    model's logits."""
    import peft
    import transformers

    from raytrain.runner import export_latest

    out = export_latest(runs["d"], str(tmp_path / "hf"))
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(out)("Which answer is better?")["input_ids"]])

    def logits(folder):
        model = transformers.MistralForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            return model(ids).logits

    with torch.no_grad():
        ours = _sequential(runs["a"])((ids, torch.arange(ids.shape[1]).view(1, -1), torch.zeros_like(ids)))
    torch.testing.assert_close(logits(os.path.join(out, "base")), ours, rtol=1e-5, atol=1e-5)
    config = json.load(open(os.path.join(out, "adapter", "adapter_config.json")))
    assert config["base_model_name_or_path"] == os.path.abspath(os.path.join(out, "base"))
    base = transformers.MistralForCausalLM.from_pretrained(os.path.join(out, "base"), attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, logits(out), rtol=1e-4, atol=1e-5)
    assert (logits(out) - ours).abs().max() > 1e-4  # the adapters moved the model away from its base


def test_two_stages_and_two_replicas_equal_one_process(runs):
    """pp 2 x dp 2 (a) and one process (c) on the same global batches: the same loss and TRL metrics step by step,
    on validation too, and the same weights at the end (fp32 CPU; sums in another order: equal to rounding)."""
    a, c = _metrics(runs["a"]), _metrics(runs["c"])
    assert sorted(a) == sorted(c) == list(range(1, MAX_STEPS + 1))
    beta = runs["a"].train.dpo.beta
    for step in a:
        for name in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "validation_loss",
                     "validation/rewards/margins"):
            if name in a[step] or name in c[step]:
                # a margin is beta x a difference of summed log-probabilities (hundreds of nats): it is rounded as
                # they are, to 1e-6 of beta x |logps|, not to 1e-5 of its own small value (seen: 1.2e-6 apart at
                # 0.069, with logps of -677.7 that agree to 7e-8)
                tolerance = 1e-6
                if name.endswith("rewards/margins"):
                    logps = a[step][name.replace("rewards/margins", "logps/chosen")]
                    tolerance = max(tolerance, 1e-6 * beta * abs(logps))
                assert c[step][name] == pytest.approx(a[step][name], rel=1e-5, abs=tolerance), (step, name)
    weights_a, weights_c = _final_weights(runs["a"]), _final_weights(runs["c"])
    assert sorted(weights_a) == sorted(weights_c)
    for name, tensor in weights_a.items():
        torch.testing.assert_close(weights_c[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_a_pair_is_never_split_across_micro_batches_or_replicas(runs):
    """From a's data traces (pp 2 x dp 2): each micro-batch a rank consumed is the one pyarrow reads at its global
    index (digest of its document ids); each pair's two segments sit next to each other in one pack of it, and
    every pair of a step reaches exactly one replica."""
    from raytrain.trainer.pack_order import epoch_order

    job = runs["a"]
    run = open_run(job)
    packed = run.paths.packed.path
    files = json.loads(open(os.path.join(packed, "_manifest.json")).read())["files"]
    doc_ids = [d for name in files for d in pq.read_table(os.path.join(packed, name), columns=["doc_ids"])
               .column("doc_ids").to_pylist()]
    order = epoch_order(len(doc_ids), 0, job.train.seed, job.train.shuffle)
    mbs = job.train.micro_batch_size
    reports = run.root.join("reports").path
    owner: dict[str, tuple[int, int]] = {}  # pair id -> (stage-0 dp rank, global micro-batch)
    for rank in range(job.train.num_workers):
        for record in map(json.loads, open(os.path.join(reports, f"data_trace_rank{rank}.jsonl"))):
            for index, digest in record["consumed"]:
                packs = [doc_ids[p] for p in order[index * mbs:(index + 1) * mbs]]
                assert hashlib.sha1("|".join(packs).encode()).hexdigest()[:16] == digest
                for pack in packs:
                    segments = pack.split(",")
                    assert len(segments) % 2 == 0 and segments[0::2] == segments[1::2]  # chosen, rejected
                    for pair in segments[0::2]:
                        if record["stage"] == 0:
                            assert owner.setdefault(pair, (record["dp_rank"], index)) == (record["dp_rank"], index)
                        else:  # the last stage read the same micro-batch as the first stage of its replica
                            assert owner[pair] == (record["dp_rank"], index)
    assert len(owner) > MAX_STEPS * job.train.global_batch_size  # several pairs per pack, every step's packs
    assert {rank for rank, _ in owner.values()} == {0, 1}


def _sequential(job) -> torch.nn.Sequential:
    """Our layers with the run's last weights, from DeepSpeed's layer files (no export code involved)."""
    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.pipeline.model import model_config

    ckpt = CheckpointStore(open_run(job).root).latest()
    return ours_from_layer_files(model_config(job.model.preset), os.path.join(ckpt.local_path, "ds"),
                                 seed=job.train.seed + 1)


def _first_pack_logps(job, model) -> np.ndarray:
    """``model``'s pair log-probabilities on the run's first training pack read by our pack reader, outside the
    pipeline (no DeepSpeed)."""
    from raytrain.dataset.pack_reader import PackReader
    from raytrain.pipeline.dpo import pair_logps

    packed = open_run(job).paths.packed
    manifest = json.loads(packed.join("_manifest.json").read_text())
    pack = PackReader(packed.uri, manifest["files"]).read([0])
    inputs = tuple(torch.from_numpy(pack[name]) for name in ("input_ids", "position_ids", "segment_ids"))
    with torch.no_grad():
        logps, _ = pair_logps(model(inputs), torch.from_numpy(pack["labels"]), inputs[2],
                              torch.from_numpy(pack["pair_segments"]).view(1, -1, 2))
    return logps.reshape(-1).numpy()


def test_export_of_a_preference_run_serves_its_weights_in_transformers(runs, tmp_path):
    """`raytrain export` of run e (DPO, started from a's weights): transformers loads the model and the tokenizer,
    and its logits are our layers' from the run's last checkpoint."""
    import transformers

    from raytrain.runner import export_latest

    e = runs["e"]
    out = export_latest(e, str(tmp_path / "hf"))
    hf = transformers.MistralForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("Which answer is better?")["input_ids"]])
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = _sequential(e)((ids, torch.arange(ids.shape[1]).view(1, -1), torch.zeros_like(ids)))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_preference_training_starts_from_another_runs_weights(runs):
    """Run e takes run a's last weights (pp 2 x dp 2 files, loaded by one stage) and none of its steps: its
    reference is a's trained model scored outside the pipeline, its first loss ln 2, its steps its own."""
    a, e = runs["a"], runs["e"]
    metrics = _metrics(e)
    assert sorted(metrics) == [1, 2]
    assert metrics[1]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # policy = reference = a's weights
    assert metrics[1]["logps/chosen"] != pytest.approx(_metrics(a)[1]["logps/chosen"], rel=1e-3)
    np.testing.assert_allclose(_reference_files(e)["train.npy"][1][0], _first_pack_logps(e, _sequential(a)),
                               rtol=1e-5, atol=1e-4)
    from raytrain.checkpoint.store import CheckpointStore

    start = CheckpointStore(open_run(e).root).latest().metadata["base"]
    assert start["init_from_run"] == open_run(a).root.uri and start["step"] == MAX_STEPS
