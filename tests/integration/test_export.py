"""Export a trained pipeline checkpoint with the real CLI (`python -m raytrain.cli export`) and load it with
transformers: the logits must equal those of our own layers loaded straight from DeepSpeed's per-layer checkpoint
files (torch.load, no export code involved), and greedy generate() must pick the same tokens, decoded by the real
Mistral tokenizer. Training data is packed by Ray Data from synthetic conversations (no Spark)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import mistral_common
import pytest
import torch
import transformers
from mistral_common.protocol.instruct.messages import UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_reference import ours_from_layer_files
from synthetic_data import SHORT, synthetic_conversations, write_packed

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.dataset.tokenize import TOKENIZER_FILES
from raytrain.pipeline.engine import DS_TAG
from raytrain.pipeline.model import MistralConfig, build_sequential
from raytrain.runner import EMBEDDED_WORKER_ENV, WORKER_ENV, open_run, run_train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/cpu-tiny.yaml"
STEPS = 3
NEW_TOKENS = 8


def _overrides(root) -> list[str]:
    return [f"storage.root={root}", "storage.run_name=export", "storage.user=ci", "train.pp=2", "train.dp=1",
            f"train.max_steps={STEPS}", f"train.checkpoint_every={STEPS}", "train.warmup_steps=1",
            "dataset.validation_fraction=0.2", f"train.generation_tokens={NEW_TOKENS}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": dict(EMBEDDED_WORKER_ENV)})
    try:
        root = tmp_path_factory.mktemp("export")
        job = load_job_config(os.path.join(ROOT, CONFIG), _overrides(root))
        # short conversations: cpu-tiny's length_policy drop refuses one longer than its 128-token packs
        write_packed(job, synthetic_conversations(40, seed=1, uuid_prefix="exp", **SHORT))
        run_train(job)
    finally:
        ray.shutdown()
    return root, job


@pytest.fixture(scope="module")
def exported(trained):
    root, job = trained
    out = os.path.join(root, "hf-export")
    proc = subprocess.run([sys.executable, "-m", "raytrain.cli", "export", CONFIG, *_overrides(root), "--out", out],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, **WORKER_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported Hugging Face model to {out}" in proc.stdout
    return out


@pytest.fixture(scope="module")
def reference_layers(trained):
    """Our nn.Sequential with each pipeline layer loaded by torch.load from DeepSpeed's layer_XX file."""
    _, job = trained
    cfg = MistralConfig.preset(job.model.preset)
    latest = CheckpointStore(open_run(job).root).latest()
    assert latest is not None and latest.step == STEPS
    return ours_from_layer_files(cfg, os.path.join(latest.local_path, DS_TAG), seed=job.train.seed + 1)


def _prompt_ids() -> torch.Tensor:
    """A chat prompt encoded by mistral-common's v3 tokenizer (the training tokenizer of cpu-tiny.yaml)."""
    return torch.tensor([_tokenizer().encode_chat_completion(
        ChatCompletionRequest(messages=[UserMessage(content="Tell me about tides and glaciers.")])).tokens])


def _tokenizer() -> MistralTokenizer:
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", TOKENIZER_FILES["v3"])
    return MistralTokenizer.from_file(path, mode=ValidationMode.test)


def _our_logits(model: torch.nn.Sequential, input_ids: torch.Tensor) -> torch.Tensor:
    batch_size, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).expand(batch_size, seq_len)  # (B, T)
    with torch.no_grad():
        return model((input_ids, position_ids, torch.zeros_like(input_ids)))  # (B, T, V)


def test_export_holds_trained_weights(exported, reference_layers, trained):
    _, job = trained
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(exported, "*")))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(files)
    untrained = build_sequential(MistralConfig.preset(job.model.preset), seed=job.train.seed)
    changed = [not torch.equal(a, b) for a, b in zip(reference_layers.parameters(), untrained.parameters(),
                                                      strict=True)]
    assert all(changed), "training must have moved every parameter away from its seeded init"


def test_from_pretrained_logits_equal_the_pipeline_layers(exported, reference_layers):
    hf = transformers.MistralForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    input_ids = _prompt_ids()  # (1, T)
    with torch.no_grad():
        hf_logits = hf(input_ids).logits  # (1, T, V)
    ours = _our_logits(reference_layers, input_ids)
    assert hf_logits.shape == ours.shape
    torch.testing.assert_close(hf_logits, ours, rtol=1e-5, atol=1e-5)


def _our_greedy(model: torch.nn.Sequential, prompt: torch.Tensor, eos: int) -> list[int]:
    """Greedy decoding with our layers, full recompute per token."""
    ids, new_ids = prompt, []
    for _ in range(NEW_TOKENS):
        next_id = int(_our_logits(model, ids)[0, -1].argmax())
        new_ids.append(next_id)
        if next_id == eos:
            break
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return new_ids


def test_generate_matches_our_greedy_decoding_and_decodes(exported, reference_layers):
    hf = transformers.MistralForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    prompt = _prompt_ids()
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=eos)
    new_tokens = generated[0, prompt.shape[1]:].tolist()
    expected = _our_greedy(reference_layers, prompt, eos)
    assert new_tokens == expected

    tokenizer = _tokenizer()
    assert max(new_tokens) < tokenizer.instruct_tokenizer.tokenizer.n_words
    text = tokenizer.decode(new_tokens)
    assert isinstance(text, str)
    print(f"\ngenerated ids {new_tokens} -> {text!r}")


def test_export_serves_with_its_own_tokenizer_and_raytrain_generate(exported, reference_layers, capsys):
    """AutoTokenizer loads the export; its chat template gives mistral-common's prompt; `raytrain generate` answers
    with the greedy tokens of our own layers, decoded."""
    from raytrain.cli import main

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    messages = [{"role": "user", "content": "Tell me about tides and glaciers."}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(prompt_ids) == _prompt_ids()[0].tolist()

    expected = _our_greedy(reference_layers, _prompt_ids(), tokenizer.eos_token_id)
    assert main(["generate", exported, messages[0]["content"], "--max-new-tokens", str(NEW_TOKENS)]) == 0
    captured = capsys.readouterr()
    assert captured.out == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert f"{len(prompt_ids)} prompt tokens, {len(expected)} generated" in captured.err


def test_checkpoint_samples_equal_transformers_greedy_decoding_of_the_export(exported, trained):
    """The greedy generations the trainer wrote at its checkpoint (through the pipeline's eval forward, one token per
    pass) equal transformers' ``generate`` on the export of that checkpoint from the same validation prompts."""
    _root, job = trained
    with open(open_run(job).root.join("reports", "generations.jsonl").path) as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [STEPS] * job.train.micro_batch_size
    hf = transformers.MistralForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    eos = hf.generation_config.eos_token_id
    for sample in samples:
        prompt = torch.tensor([sample["prompt_ids"]])
        with torch.no_grad():
            out = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=eos)
        assert out[0, prompt.shape[1]:].tolist() == sample["generated_ids"]
        assert sample["prompt"].strip() and sample["reference"].strip()  # decoded text beside the ids
