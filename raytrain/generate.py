"""`raytrain generate`: answer a prompt with an exported model through transformers, as a server would.

In:  an export folder (``config.json`` + safetensors + the tokenizer files of ``raytrain.dataset.hf_tokenizer``), a
     LoRA export's PEFT adapter folder (loaded onto its ``base_model_name_or_path`` with peft), or a run folder whose
     ``exports/step_N/`` hold exports (the newest step is used); a user prompt and an optional system prompt.
Out: the greedy continuation, decoded without special tokens, and its token ids.

Everything goes through transformers' public API — ``AutoTokenizer.from_pretrained`` (mistral-common underneath),
``apply_chat_template(..., add_generation_prompt=True)``, ``AutoModelForCausalLM.from_pretrained`` and
``generate(do_sample=False)`` — so what works here works for anyone serving the export with transformers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from raytrain.checkpoint.layout import parse_step_dir_name
from raytrain.errors import RaytrainError


@dataclass(frozen=True)
class Generation:
    """One greedy answer."""

    model_dir: Path
    prompt_ids: list[int]
    """The chat prompt as the tokenizer's chat template encodes it (ends with the generation prompt)."""
    new_ids: list[int]
    """Generated token ids, the closing EOS included when the model produced it."""
    text: str
    """``new_ids`` decoded, special tokens skipped."""


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """An export folder itself, or the newest ``exports/step_N`` of a run folder."""
    folder = Path(path)
    if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return folder
    exports = folder / "exports"
    steps = sorted((step, child) for child in (exports.iterdir() if exports.is_dir() else [])
                   if (step := parse_step_dir_name(child.name)) is not None and (child / "config.json").is_file())
    if steps:
        return steps[-1][1]
    raise RaytrainError(f"{folder} is neither an exported model (no config.json) nor a run folder with exports "
                        f"under {exports}; export one first: raytrain export CONFIG [--out DIR]")


def generate(path: str | os.PathLike, prompt: str, *, system: str = "", max_new_tokens: int = 64) -> Generation:
    """Greedy-decode up to ``max_new_tokens`` after the chat prompt [system?, user ``prompt``]."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy imports, only needed here

    model_dir = resolve_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise RaytrainError(f"{model_dir}: transformers cannot load a tokenizer ({exc}); exports written before "
                            "raytrain wrote tokenizer files need a new `raytrain export`") from exc
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    if (model_dir / "adapter_config.json").is_file():  # a LoRA export's adapter folder: onto its base, with peft
        from peft import PeftConfig, PeftModel

        base_dir = PeftConfig.from_pretrained(model_dir).base_model_name_or_path
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), model_dir).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                      dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos)
    new_ids = output[0, len(prompt_ids):].tolist()
    return Generation(model_dir, prompt_ids, new_ids, tokenizer.decode(new_ids, skip_special_tokens=True))


__all__ = ["Generation", "generate", "resolve_model_dir"]
