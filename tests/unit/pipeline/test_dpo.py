"""DPO on packed pairs (raytrain.pipeline.dpo, raytrain.dataset.pair_pack) against TRL's DPOTrainer on transformers'
MistralForCausalLM: the same pairs, TRL padded one sequence per row, ours packed several pairs per row."""

import contextlib
import copy
import math

import numpy as np
import pytest
import torch
import transformers
from mistral_reference import hf_model, ours_from_hf

from raytrain.config import DpoConfig, load_job_config
from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.dataset.pair_pack import pack_pairs
from raytrain.dataset.tokenize import TokenizedPair
from raytrain.errors import ConfigError, RaytrainError
from raytrain.pipeline.dpo import METRICS, PackedPairs, micro_batch_loss, pair_logps
from raytrain.pipeline.model import MistralConfig, hf_prefix

trl = pytest.importorskip("trl")  # a test dependency (pyproject's [test] extra)
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

CFG = MistralConfig.preset("tiny")
SEQ_LEN, MAX_PAIRS = 40, 2
# (prompt, chosen, rejected) lengths: three pairs that make two packs of SEQ_LEN (two pairs, then one)
LENGTHS = [(5, 4, 6), (3, 7, 2), (6, 3, 3)]


def random_pairs(seed: int = 1) -> list[TokenizedPair]:
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, CFG.vocab_size, (n,), generator=generator).tolist()

    return [TokenizedPair(f"pair-{i}", ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def models():
    """A policy and a reference that differs from it (so rewards are not all 0), as HF models and as our layers."""
    policy = hf_model(CFG, seed=0)
    reference = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return policy, reference


def packed(pairs: list[TokenizedPair]) -> PackedPairs:
    rows = list(pack_pairs(pairs, SEQ_LEN, MAX_PAIRS))

    def stack(name: str) -> torch.Tensor:
        return torch.from_numpy(np.stack([getattr(row.pack, name) for row in rows]))

    return PackedPairs(labels=stack("labels"), segment_ids=stack("segment_ids"),
                       pair_segments=torch.from_numpy(np.stack([row.pair_segments for row in rows])),
                       ref_logps=torch.zeros(len(rows), MAX_PAIRS, 2)), stack("input_ids"), stack("position_ids")


def ours_step(policy_hf, reference_hf, pairs, settings: DpoConfig):
    """Our loss, metric means and gradients (by HF parameter name) for ``pairs`` as one batch."""
    batch, input_ids, position_ids = packed(pairs)
    reference = ours_from_hf(CFG, reference_hf)
    with torch.no_grad():
        batch.ref_logps, _ = pair_logps(reference((input_ids, position_ids, batch.segment_ids)), batch.labels,
                                        batch.segment_ids, batch.pair_segments)
    policy = ours_from_hf(CFG, policy_hf).train()
    logits = policy((input_ids, position_ids, batch.segment_ids))
    chosen_tokens = sum(len(p.chosen) for p in pairs)
    loss, sums = micro_batch_loss(logits, batch, settings, pair_scale=1 / len(pairs), sft_scale=1 / chosen_tokens)
    loss.backward()
    grads = {hf_prefix(i, CFG) + name: param.grad for i, layer in enumerate(policy)
             for name, param in layer.named_parameters()}
    assert sums["pairs"] == len(pairs) and sums["tokens/chosen"] == chosen_tokens
    return loss.detach(), {name: sums[name] / sums["pairs"] for name in METRICS}, grads


def trl_step(policy_hf, reference_hf, pairs, settings: DpoConfig, tmp_path):
    """TRL's loss, metrics and gradients for the same pairs: its own collator and DPOTrainer._compute_loss."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from raytrain.dataset.hf_tokenizer import save_hf_tokenizer

    loss_types, weights = [settings.loss], [1.0]
    if settings.sft_weight:
        loss_types, weights = [settings.loss, "sft"], [1.0, settings.sft_weight]
    # bf16=False: TRL's default would run the reference model under bf16 autocast (the policy not), off by ~1e-2
    args = DPOConfig(output_dir=str(tmp_path), beta=settings.beta, loss_type=loss_types, loss_weights=weights,
                     label_smoothing=settings.label_smoothing, report_to=[], use_cpu=True, bf16=False,
                     pad_token="</s>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_hf_tokenizer("v3", tmp_path / "tokenizer"))
    trainer = DPOTrainer(model=copy.deepcopy(policy_hf), ref_model=copy.deepcopy(reference_hf), args=args,
                         processing_class=tokenizer,  # the batch below is built from token ids; this text is unused
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    examples = [{"prompt_ids": list(p.prompt), "chosen_ids": list(p.chosen), "rejected_ids": list(p.rejected)}
                for p in pairs]
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, DataCollatorForPreference(pad_token_id=0)(examples), False)
    loss.backward()
    metrics = {name: trainer._metrics["train"][name][-1] for name in METRICS}
    return loss.detach(), metrics, {name: param.grad for name, param in trainer.model.named_parameters()}


@pytest.mark.parametrize("settings", [DpoConfig(loss="sigmoid", beta=0.1),
                                      DpoConfig(loss="sigmoid", beta=0.5, sft_weight=0.3),
                                      DpoConfig(loss="ipo", beta=0.1),
                                      DpoConfig(loss="robust", beta=0.2, label_smoothing=0.1)],
                         ids=["sigmoid", "sigmoid+sft", "ipo", "robust"])
def test_loss_rewards_and_gradients_equal_trl(models, settings, tmp_path):
    pairs = random_pairs()
    loss, metrics, grads = ours_step(*models, pairs, settings)
    trl_loss, trl_metrics, trl_grads = trl_step(*models, pairs, settings, tmp_path)
    torch.testing.assert_close(loss, trl_loss.float(), rtol=1e-4, atol=0)
    for name in METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-4, abs=1e-6), name
    assert set(grads) == set(trl_grads)
    for name, grad in grads.items():  # relative to the tensor's norm: fp32 summation order differs element-wise
        error = (grad - trl_grads[name]).norm() / trl_grads[name].norm()
        assert error < 1e-4, f"{name}: gradient differs from TRL's by {error:.1e} of its norm"
    assert metrics["rewards/chosen"] != 0  # the reference differs from the policy: the comparison is not 0 == 0


def test_policy_equal_to_reference_gives_ln2_and_zero_rewards(models):
    policy, _ = models
    loss, metrics, _ = ours_step(policy, policy, random_pairs(), DpoConfig())
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[name] == pytest.approx(0, abs=1e-6)
    assert metrics["rewards/accuracies"] == 0  # chosen > rejected is strict: ties are not accurate (as in TRL)
    assert metrics["logps/chosen"] < 0 and metrics["logps/rejected"] < 0


def test_pairs_are_never_split_and_labels_cover_only_the_responses():
    pairs = random_pairs()
    rows = list(pack_pairs(pairs, SEQ_LEN, MAX_PAIRS))
    assert [row.pair_ids for row in rows] == [["pair-0", "pair-1"], ["pair-2"]]
    by_id = {pair.pair_id: pair for pair in pairs}
    for row in rows:
        pack = row.pack
        for slot, pair_id in enumerate(row.pair_ids):
            pair = by_id[pair_id]
            for side, response in enumerate((pair.chosen, pair.rejected)):
                where = pack.segment_ids == row.pair_segments[slot, side]
                assert pack.input_ids[where].tolist() == list(pair.prompt) + list(response)
                # the targets are the response's tokens, predicted from the token before each
                targets = pack.labels[where]
                assert targets[targets != IGNORE_INDEX].tolist() == list(response)
        assert (row.pair_segments[len(row.pair_ids):] == -1).all()
    assert sum(row.pack.num_real_tokens for row in rows) == sum(pair.num_tokens for pair in pairs)


def test_a_pair_too_long_for_a_pack_is_refused_by_name():
    long_pair = TokenizedPair("long", [1] * 10, [2] * 15, [3] * 10)
    with pytest.raises(RaytrainError, match="pair 'long' takes 45 tokens .* > seq_len=40"):
        list(pack_pairs([long_pair], SEQ_LEN, MAX_PAIRS))
    with pytest.raises(RaytrainError, match="pair 'empty': a response has no tokens"):
        list(pack_pairs([TokenizedPair("empty", [1], [], [3])], SEQ_LEN, MAX_PAIRS))


def test_settings_refuse_what_has_no_effect():
    with pytest.raises(ConfigError, match=r"train.dpo.label_smoothing: 0.1 has no effect on the sigmoid loss; use "
                                          r"train.dpo.loss=robust"):
        DpoConfig(label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"train.dpo.loss: 'hinge': choose one of \['sigmoid', 'ipo', 'robust'\]"):
        DpoConfig(loss="hinge")
    with pytest.raises(ConfigError, match="train.dpo.beta: 0: must be > 0"):
        DpoConfig(beta=0)
    with pytest.raises(ConfigError, match="train.objective: 'ppo': choose 'sft' or 'dpo'"):
        load_job_config(None, ["train.objective=ppo"])
    job = load_job_config(None, ["train.objective=dpo", "train.dpo.beta=0.5"])
    assert job.train.dpo.beta == 0.5
    assert job.data_hash() != load_job_config(None, []).data_hash()  # pairs are other data from the same input


def test_a_deepspeed_step_over_two_micro_batches_equals_trl_on_the_global_batch(gloo_group, models, tmp_path):
    """The pairs of one global batch in two micro-batches of one pack each (2 pairs, then 1), through the real
    DeepSpeed pipeline engine with DpoLoss and the training feed's scales: the step's loss, gradients and metrics
    are TRL's over all three pairs (a mean over pairs, not a mean of the micro-batches' means)."""
    import deepspeed

    from raytrain.pipeline.dpo import DpoLoss
    from raytrain.pipeline.hf_io import load_hf_into_stage
    from raytrain.pipeline.module import build_pipeline_module
    from raytrain.trainer.feed import to_pair_micro_batch

    policy_hf, reference_hf = models
    settings = DpoConfig(loss="sigmoid", beta=0.3, sft_weight=0.2)
    pairs = random_pairs()
    batch, input_ids, position_ids = packed(pairs)
    with torch.no_grad():
        ref_logps, _ = pair_logps(ours_from_hf(CFG, reference_hf)((input_ids, position_ids, batch.segment_ids)),
                                  batch.labels, batch.segment_ids, batch.pair_segments)
    accumulation = 2  # m; dp = 1
    pair_scale = accumulation / len(pairs)  # dp * m / pairs of the global batch
    sft_scale = accumulation / sum(len(p.chosen) for p in pairs)  # dp * m / chosen tokens of the global batch
    feed = [to_pair_micro_batch({"input_ids": input_ids[i:i + 1].numpy(), "position_ids": position_ids[i:i + 1].numpy(),
                                 "segment_ids": batch.segment_ids[i:i + 1].numpy(), "labels": batch.labels[i:i + 1].numpy(),
                                 "pair_segments": batch.pair_segments[i:i + 1].reshape(1, -1).numpy(),
                                 "ref_logps": ref_logps[i:i + 1].reshape(1, -1).numpy()}, pair_scale, sft_scale)
            for i in range(accumulation)]
    hf_dir = tmp_path / "policy"
    policy_hf.save_pretrained(hf_dir)
    loss_fn = DpoLoss(settings)
    module = build_pipeline_module(CFG, num_stages=1, loss_fn=loss_fn)
    load_hf_into_stage(module, hf_dir)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "gradient_clipping": 0.0, "steps_per_print": 10_000}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    names = {id(p): hf_prefix(i, CFG) + n for i, layer in enumerate(module.forward_funcs)
             for n, p in layer.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    engine.optimizer.register_step_pre_hook(
        lambda optimizer, _a, _k: grads.update({names[id(p)]: p.grad.detach().clone()
                                                for group in optimizer.param_groups for p in group["params"]}))
    loss = float(engine.train_batch(data_iter=iter(feed)))
    sums = loss_fn.take_sums()

    trl_loss, trl_metrics, trl_grads = trl_step(policy_hf, reference_hf, pairs, settings, tmp_path)
    assert loss == pytest.approx(float(trl_loss), rel=1e-5)
    assert sums["pairs"] == len(pairs) and loss_fn.sums == {}
    for name in METRICS:
        assert sums[name] / sums["pairs"] == pytest.approx(trl_metrics[name], rel=1e-4, abs=1e-6), name
    for name, grad in grads.items():
        error = (grad - trl_grads[name]).norm() / trl_grads[name].norm()
        assert error < 1e-4, f"{name}: gradient differs from TRL's by {error:.1e} of its norm"
    assert set(grads) == set(trl_grads)


def test_pair_pack_batch_columns_count_pairs_and_chosen_targets():
    import pandas as pd

    from raytrain.dataset.pair_pack import pair_pack_batch

    pairs = random_pairs()
    frame = pd.DataFrame({"uuid": [p.pair_id for p in pairs], "prompt_ids": [list(p.prompt) for p in pairs],
                          "chosen_ids": [list(p.chosen) for p in pairs],
                          "rejected_ids": [list(p.rejected) for p in pairs]})
    out = pair_pack_batch(frame, SEQ_LEN, max_pairs=MAX_PAIRS)
    assert out["pair_segments"].tolist() == [[0, 1, 2, 3], [0, 1, -1, -1]]
    assert out["num_pairs"].tolist() == [2, 1]
    assert out["doc_ids"].tolist() == ["pair-0,pair-0,pair-1,pair-1", "pair-2,pair-2"]
    assert out["chosen_targets"].tolist() == [len(pairs[0].chosen) + len(pairs[1].chosen), len(pairs[2].chosen)]
    assert out["num_targets"].sum() == sum(len(p.chosen) + len(p.rejected) for p in pairs)
    assert out["input_ids"].shape == (2, SEQ_LEN)


def test_adapters_disabled_gives_the_base_model_and_restores_the_adapters():
    """A LoRA run's reference: with the adapters off the stage computes the base model's logits exactly; after,
    the adapted logits and the adapters' requires_grad are back."""
    from raytrain.config import LoraConfig
    from raytrain.pipeline.lora import adapters_disabled, add_adapters
    from raytrain.pipeline.model import build_sequential

    model = build_sequential(CFG, seed=3).eval()
    inputs = (torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4)),
              torch.arange(12).expand(2, 12), torch.zeros(2, 12, dtype=torch.long))
    with torch.no_grad():
        base = model(inputs)
    add_adapters(model, LoraConfig(rank=4, alpha=8.0), seed=3)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        adapted = model(inputs)
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        with adapters_disabled(model):
            off = model(inputs)
            assert not any(param.requires_grad for param in model.parameters())
        again = model(inputs)
    assert (adapted - base).abs().max() > 1e-3  # the adapters change the model
    torch.testing.assert_close(off, base, rtol=0, atol=0)
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)
    assert {name for name, param in model.named_parameters() if param.requires_grad} == trainable
    assert trainable and all(".lora_" in name for name in trainable)


def test_reference_pass_through_deepspeed_records_the_starting_models_logps(gloo_group, models, tmp_path):
    """The reference pass is DeepSpeed's pipeline eval schedule with DpoLoss recording: each micro-batch's pair
    log-probabilities, in order, equal those of the starting weights computed outside DeepSpeed; on a LoRA stage
    with the adapters off they are the base model's although the adapters are not zero."""
    import deepspeed

    from raytrain.config import LoraConfig
    from raytrain.pipeline.dpo import DpoLoss
    from raytrain.pipeline.hf_io import load_hf_into_stage
    from raytrain.pipeline.lora import adapters_disabled, add_adapters
    from raytrain.pipeline.module import build_pipeline_module
    from raytrain.trainer.feed import to_pair_micro_batch

    _, reference_hf = models
    batch, input_ids, position_ids = packed(random_pairs())
    with torch.no_grad():
        expected, _ = pair_logps(ours_from_hf(CFG, reference_hf)((input_ids, position_ids, batch.segment_ids)),
                                 batch.labels, batch.segment_ids, batch.pair_segments)
    feed = [to_pair_micro_batch({"input_ids": input_ids[i:i + 1].numpy(), "position_ids": position_ids[i:i + 1].numpy(),
                                 "segment_ids": batch.segment_ids[i:i + 1].numpy(), "labels": batch.labels[i:i + 1].numpy(),
                                 "pair_segments": batch.pair_segments[i:i + 1].reshape(1, -1).numpy(),
                                 "ref_logps": np.zeros((1, 2 * MAX_PAIRS), dtype=np.float32)}, 0.0, 0.0)
            for i in range(2)]
    hf_dir = tmp_path / "reference"
    reference_hf.save_pretrained(hf_dir)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10_000}
    for lora in (False, True):
        loss_fn = DpoLoss(DpoConfig())
        module = build_pipeline_module(CFG, num_stages=1, loss_fn=loss_fn)
        load_hf_into_stage(module, hf_dir)
        if lora:
            add_adapters(module, LoraConfig(rank=4, alpha=8.0), seed=0)
            with torch.no_grad():
                for name, param in module.named_parameters():
                    if ".lora_B" in name:
                        param.fill_(0.05)
        engine, _, _, _ = deepspeed.initialize(model=module, config=config,
                                               model_parameters=[p for p in module.parameters() if p.requires_grad])
        with adapters_disabled(module) if lora else contextlib.nullcontext(), loss_fn.recording() as recorded:
            engine.eval_batch(iter(feed), num_micro_batches=2)
        torch.testing.assert_close(torch.cat(recorded), expected, rtol=1e-5, atol=1e-4)
        if lora:
            with loss_fn.recording() as adapted:
                engine.eval_batch(iter(feed), num_micro_batches=2)
            assert (torch.cat(adapted) - expected).abs().max() > 1e-2  # on, the adapters change the log-probs
