"""pp x dp topologies in Ray Train on CPU (gloo), without Spark: synthetic conversations are tokenized and packed by
Ray Data straight into a run's data folder, then `raytrain.runner.run_train` trains a tiny Mistral.

Checks, per topology: the loss is finite and falls; data-parallel replicas of a stage end with identical weights;
both stages of one pipeline consumed the same micro-batches (by document ids); the replicas consumed disjoint
micro-batches covering every global index; and every consumed micro-batch is the one pyarrow reads at that position
of the packed files. pp=2 and pp=1 trained on the same data and seed give the same losses.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from synthetic_data import synthetic_conversations, write_packed
from wandb_offline import wandb_offline_history

from raytrain.config import load_job_config
from raytrain.pipeline.model import MistralConfig, layer_parameter_counts
from raytrain.runner import open_run, run_train

STEPS = 4
CONFIG = "configs/cpu-tiny.yaml"


def make_job(root, run_name: str, *overrides: str):
    # length_policy=split: some synthetic conversations are longer than the 128-token packs; these tests check the
    # topology's math on packs, not the length policy (tests/unit/dataset/test_length_policy.py does)
    return load_job_config(CONFIG, [f"storage.root={root}", f"storage.run_name={run_name}", "storage.user=ci",
                                    f"train.max_steps={STEPS}", f"train.checkpoint_every={STEPS}",
                                    "train.warmup_steps=1", "dataset.length_policy=split",
                                    "dataset.validation_fraction=0.1", *overrides])


def copy_packed(src_job, dst_job) -> None:
    """Same packed data for another run (same data hash: only train.* differs)."""
    shutil.copytree(open_run(src_job).root.join("data", "packed").path,
                    open_run(dst_job).root.join("data", "packed").path)


def read_reports(job) -> dict:
    reports = open_run(job).root.join("reports").path
    out: dict = {"metrics": [], "traces": {}, "digests": {}}
    with open(os.path.join(reports, "metrics.jsonl")) as f:
        out["metrics"] = [json.loads(line) for line in f]
    for name in sorted(os.listdir(reports)):
        rank = name.rsplit("rank", 1)[-1].split(".")[0]
        if name.startswith("data_trace_rank"):
            with open(os.path.join(reports, name)) as f:
                out["traces"][int(rank)] = [json.loads(line) for line in f]
        elif name.startswith("param_digest_rank"):
            with open(os.path.join(reports, name)) as f:
                out["digests"][int(rank)] = json.load(f)
    return out


def reference_micro_batch_digests(job) -> list[str]:
    """Per global micro-batch of the first two epochs: the packs the epoch's order (raytrain.trainer.pack_order.epoch_order,
    train.seed, train.shuffle) puts there, read by pyarrow from the manifest's files, not by the trainer's reader,
    as the digest the trainer records (sha1 of the segments' document ids joined by '|')."""
    from raytrain.trainer.pack_order import epoch_order

    packed = open_run(job).root.join("data", "packed").path
    with open(os.path.join(packed, "_manifest.json")) as f:
        files = json.load(f)["files"]
    doc_ids = [d for name in files for d in pq.read_table(os.path.join(packed, name), columns=["doc_ids"])
               .column("doc_ids").to_pylist()]
    mbs, per_epoch = job.train.micro_batch_size, len(doc_ids) // job.train.micro_batch_size
    return [hashlib.sha1("|".join(doc_ids[p] for p in order[k * mbs:(k + 1) * mbs]).encode()).hexdigest()[:16]
            for order in (epoch_order(len(doc_ids), e, job.train.seed, job.train.shuffle) for e in range(2))
            for k in range(per_epoch)]


@pytest.fixture(scope="module")
def pp2_dp2(ray_six_cpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("topologies")
    job = make_job(root, "pp2-dp2", "train.pp=2", "train.dp=2")
    packed = write_packed(job, synthetic_conversations(90, uuid_prefix="syn"))
    # one epoch must hold every step's micro-batches, so "cover every global index" means distinct packs
    assert packed.num_packs // job.train.micro_batch_size >= STEPS * job.train.dp * job.train.grad_accum_steps
    # enough held-out packs for both replicas to evaluate (one replica gets the short last micro-batch)
    assert packed.validation is not None and packed.validation.num_packs > job.train.dp * job.train.micro_batch_size
    summary = run_train(job)
    return job, summary, read_reports(job)


@pytest.fixture(scope="module")
def pp1_dp2(pp2_dp2):
    src_job = pp2_dp2[0]
    job = make_job(src_job.storage.root, "pp1-dp2", "train.pp=1", "train.dp=2", "train.tracking=[mlflow,wandb]")
    copy_packed(src_job, job)
    summary = run_train(job)
    return job, summary, read_reports(job)


def _world_rank(stage: int, dp_rank: int, dp: int) -> int:
    return stage * dp + dp_rank  # DeepSpeed's PipeDataParallelTopology: pipe-major


@pytest.mark.parametrize("topology", ["pp2_dp2", "pp1_dp2"])
def test_loss_finite_and_decreasing(topology, request):
    job, summary, reports = request.getfixturevalue(topology)
    metrics = reports["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses = [m["loss"] for m in metrics]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert summary["final"]["step"] == STEPS
    assert all(m["pipeline_bubble"] == pytest.approx((job.train.pp - 1) / (job.train.grad_accum_steps + job.train.pp
                                                                           - 1)) for m in metrics)


@pytest.mark.parametrize("topology", ["pp2_dp2", "pp1_dp2"])
def test_dp_replicas_end_with_identical_weights(topology, request):
    job, _, reports = request.getfixturevalue(topology)
    tc = job.train
    digests = reports["digests"]
    assert sorted(digests) == list(range(tc.pp * tc.dp))
    names_per_stage = []
    for stage in range(tc.pp):
        replicas = [digests[_world_rank(stage, r, tc.dp)] for r in range(tc.dp)]
        assert all(d["step"] == STEPS and d["stage"] == stage for d in replicas)
        assert all(d["digests"] == replicas[0]["digests"] for d in replicas[1:]), f"stage {stage} replicas differ"
        names_per_stage.append(set(replicas[0]["digests"]))
    # the stages hold disjoint layers that together make the whole model (embedding on the first, head on the last)
    all_names = set().union(*names_per_stage)
    assert sum(len(n) for n in names_per_stage) == len(all_names)
    assert any(n.startswith("0.") for n in names_per_stage[0])
    last_layer = MistralConfig.preset(job.model.preset).num_pipeline_layers - 1  # the LM head
    assert any(n.startswith(f"{last_layer}.") for n in names_per_stage[-1])


def test_stages_of_a_pipeline_consumed_identical_micro_batches(pp2_dp2):
    job, _, reports = pp2_dp2
    tc = job.train
    traces = reports["traces"]
    assert sorted(traces) == list(range(tc.pp * tc.dp))  # pp=2: both stages read (inputs / labels)
    for dp_rank in range(tc.dp):
        first, last = traces[_world_rank(0, dp_rank, tc.dp)], traces[_world_rank(1, dp_rank, tc.dp)]
        assert len(first) == STEPS
        assert all(len(row["consumed"]) == tc.grad_accum_steps for row in first)
        assert [(r["step"], r["consumed"]) for r in first] == [(r["step"], r["consumed"]) for r in last]


@pytest.mark.parametrize("topology", ["pp2_dp2", "pp1_dp2"])
def test_replicas_consumed_disjoint_micro_batches_covering_every_index(topology, request):
    job, _, reports = request.getfixturevalue(topology)
    tc = job.train
    reference = reference_micro_batch_digests(job)
    per_replica = []
    for dp_rank in range(tc.dp):
        rows = reports["traces"][_world_rank(0, dp_rank, tc.dp)]
        per_replica.append([tuple(c) for row in rows for c in row["consumed"]])
    indices = [{i for i, _ in consumed} for consumed in per_replica]
    assert not set.intersection(*indices)
    assert set.union(*indices) == set(range(STEPS * tc.dp * tc.grad_accum_steps))
    # each micro-batch holds the packs its epoch's order puts at that position, read independently by pyarrow
    for consumed in per_replica:
        for index, digest in consumed:
            assert digest == reference[index]
    # and replica r took the m consecutive micro-batches starting at step * dp * m + r * m
    for dp_rank, consumed in enumerate(per_replica):
        for step in range(STEPS):
            start = step * tc.dp * tc.grad_accum_steps + dp_rank * tc.grad_accum_steps
            got = [i for i, _ in consumed[step * tc.grad_accum_steps:(step + 1) * tc.grad_accum_steps]]
            assert got == list(range(start, start + tc.grad_accum_steps))


def test_pipeline_split_does_not_change_the_math(pp2_dp2, pp1_dp2):
    """Same seed, data and global batch: 2 stages and 1 stage must train the same model (fp32, CPU)."""
    losses_pp2 = [m["loss"] for m in pp2_dp2[2]["metrics"]]
    losses_pp1 = [m["loss"] for m in pp1_dp2[2]["metrics"]]
    assert losses_pp2 == pytest.approx(losses_pp1, rel=1e-5)


LORA = ("model.lora.rank=4", "model.lora.alpha=8")


@pytest.fixture(scope="module")
def lora_pp2_dp2(pp2_dp2):
    src = pp2_dp2[0]
    job = make_job(src.storage.root, "lora-pp2-dp2", "train.pp=2", "train.dp=2", *LORA)
    copy_packed(src, job)
    run_train(job)
    return job, read_reports(job)


@pytest.fixture(scope="module")
def lora_pp1_dp1(lora_pp2_dp2):
    """One stage, one replica, the same global batch (twice the micro-batches per step)."""
    src = lora_pp2_dp2[0]
    job = make_job(src.storage.root, "lora-pp1-dp1", "train.pp=1", "train.dp=1",
                   f"train.grad_accum_steps={src.train.grad_accum_steps * src.train.dp}", *LORA)
    assert job.train.global_batch_size == src.train.global_batch_size
    copy_packed(src, job)
    run_train(job)
    return job, read_reports(job)


def test_lora_pipeline_and_replicas_do_not_change_the_math(lora_pp2_dp2, lora_pp1_dp1):
    """LoRA with pp=2 x dp=2 and with pp=1 x dp=1 on the same global batches: the same losses step by step and the
    same adapters at the end (fp32, CPU; the sums run in another order, so equal to rounding)."""
    import torch

    from raytrain.checkpoint.store import CheckpointStore

    (a, reports_a), (b, reports_b) = lora_pp2_dp2, lora_pp1_dp1
    assert [m["loss"] for m in reports_a["metrics"]] == pytest.approx([m["loss"] for m in reports_b["metrics"]],
                                                                      rel=1e-5)
    adapters = []
    for job in (a, b):
        ckpt = CheckpointStore(open_run(job).root).latest()
        assert ckpt.step == STEPS
        adapters.append({f"{layer}.{name}": tensor for layer in (1, 2) for name, tensor in torch.load(
            os.path.join(ckpt.local_path, "ds", f"layer_{layer:02d}-model_states.pt"), weights_only=True).items()})
    assert sorted(adapters[0]) == sorted(adapters[1]) and len(adapters[0]) == 2 * 2 * 7
    for name, tensor in adapters[0].items():
        torch.testing.assert_close(tensor, adapters[1][name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(t.abs().max() > 0 for n, t in adapters[0].items() if "lora_B" in n)  # the adapters trained


def _token_losses(model, packed_dir: str, files: list[str], micro_batch_size: int, packs=None
                  ) -> tuple[float, int, int]:
    """`model` over the packs numbered `packs` (all, in order: None) read by pyarrow, in micro-batches: summed token
    cross-entropy, target tokens, real (non-padding: segment id != -1) tokens."""
    import numpy as np
    import torch

    from raytrain.dataset.labels import IGNORE_INDEX

    columns = ["input_ids", "position_ids", "segment_ids", "labels"]
    table = pa.concat_tables([pq.read_table(os.path.join(packed_dir, name), columns=columns) for name in files])
    packs = list(range(table.num_rows)) if packs is None else list(packs)
    rows = len(packs)
    tensors = [torch.from_numpy(np.array(table.column(c).to_pylist(), dtype=np.int64)[packs]) for c in columns]
    loss_sum, targets = 0.0, 0
    with torch.no_grad():
        for start in range(0, rows, micro_batch_size):
            ids, pos, seg, labels = (t[start:start + micro_batch_size] for t in tensors)
            logits = model((ids, pos, seg))
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum"))
            targets += int((labels != IGNORE_INDEX).sum())
    return loss_sum, targets, int((tensors[2] != -1).sum())


def test_first_step_loss_is_the_token_mean_over_the_global_batch(pp2_dp2):
    """pp=2 x dp=2: the step-1 loss equals a single-process forward of the seeded initial model over the step's
    dp * m micro-batches (the first packs of epoch 0's order, read from the packed files by pyarrow), summed over
    every target token and divided by their count: token-weighted across micro-batches and replicas
    (raytrain.trainer.feed's loss_scale)."""
    from raytrain.pipeline.model import build_sequential
    from raytrain.trainer.pack_order import epoch_order

    job, _summary, reports = pp2_dp2
    tc = job.train
    packed = open_run(job).root.join("data", "packed").path
    with open(os.path.join(packed, "_manifest.json")) as f:
        manifest = json.load(f)
    files = manifest["files"]
    model = build_sequential(MistralConfig.preset(job.model.preset), seed=tc.seed).eval()
    rows = tc.dp * tc.grad_accum_steps * tc.micro_batch_size  # the global batch of step 1, in order
    order = epoch_order(manifest["num_packs"], 0, tc.seed, tc.shuffle)
    loss_sum, targets, real_tokens = _token_losses(model, packed, files, tc.micro_batch_size, order[:rows])
    assert reports["metrics"][0]["step"] == 1
    assert reports["metrics"][0]["loss"] == pytest.approx(loss_sum / targets, rel=1e-5)
    # the step's counts, as the trainer reports them, are the global batch's (all replicas), not one replica's
    assert reports["metrics"][0]["target_tokens"] == targets
    assert reports["metrics"][0]["real_tokens"] == real_tokens


@pytest.mark.parametrize("topology", ["pp2_dp2", "pp1_dp2"])
def test_validation_loss_is_the_token_mean_over_the_validation_set(topology, request):
    """At the last step: the validation loss equals a single-process forward of the step-4 checkpoint's weights
    (DeepSpeed's layer files, torch.load) over every held-out pack (pyarrow), per target token; dp replicas share
    the set (one of them gets the short last micro-batch)."""
    import torch

    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.pipeline.engine import DS_TAG
    from raytrain.pipeline.model import build_sequential

    job, _summary, reports = request.getfixturevalue(topology)
    latest = CheckpointStore(open_run(job).root).latest()
    assert latest.step == STEPS
    model = build_sequential(MistralConfig.preset(job.model.preset), seed=job.train.seed + 1)
    for index, layer in enumerate(model):
        layer.load_state_dict(torch.load(os.path.join(latest.local_path, DS_TAG, f"layer_{index:02d}-model_states.pt"),
                                         map_location="cpu", weights_only=True))
    packed_dir = open_run(job).root.join("data", "packed").path
    with open(os.path.join(packed_dir, "_manifest.json")) as f:
        held_out = json.load(f)["validation"]
    loss_sum, targets, _ = _token_losses(model.eval(), os.path.join(packed_dir, "validation"), held_out["files"],
                                         job.train.micro_batch_size)
    reference = loss_sum / targets
    evaluated = [m for m in reports["metrics"] if "validation_loss" in m]
    assert [m["step"] for m in evaluated] == [STEPS]  # train.eval_every=0: only at the end
    assert evaluated[0]["validation_loss"] == pytest.approx(reference, rel=1e-5)


def test_mlflow_and_wandb_record_the_run_offline(pp1_dp2):
    """train.tracking=[mlflow, wandb] through Ray's integrations, offline: MLflow's file store under reports/mlruns
    holds the run with the config as params and every step's loss (read back by MLflow's client), and W&B's offline
    run under reports/wandb holds every step's loss in its record log (read with wandb's protobuf messages)."""
    from mlflow.tracking import MlflowClient

    job, _summary, reports = pp1_dp2
    reports_dir = open_run(job).root.join("reports").path
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file://{reports_dir}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name(job.storage.project).experiment_id])
    assert run.data.params["train.dp"] == "2" and run.info.run_name == job.storage.run_name
    # a full fine-tune trains every parameter: the counts beside the config (LoRA runs: tests/integration/test_lora.py)
    assert run.data.params["parameters.trainable"] == run.data.params["parameters.total"] == \
        str(sum(layer_parameter_counts(MistralConfig.preset(job.model.preset))))
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, STEPS + 1))
    assert [m.value for m in history] == pytest.approx([m["loss"] for m in reports["metrics"]])
    assert client.get_metric_history(run.info.run_id, "validation_loss")[-1].step == STEPS

    logged = wandb_offline_history(os.path.join(reports_dir, "wandb"), "loss")
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert [logged[step] for step in sorted(logged)] == pytest.approx([m["loss"] for m in reports["metrics"]])
