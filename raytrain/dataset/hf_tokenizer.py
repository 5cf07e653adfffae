"""The training tokenizer as files ``transformers.AutoTokenizer`` loads, encoding chats exactly as training did.

In:  a tokenizer version ("v1" | "v3", the mistral-common files ``raytrain.dataset.tokenize`` trains with) and a
     folder (an exported model directory).
Out: ``tokenizer.model.<version>`` (the SentencePiece file itself) and ``tokenizer_config.json`` naming
     transformers' ``MistralCommonBackend``. ``AutoTokenizer.from_pretrained(folder)`` then wraps mistral-common's
     own ``MistralTokenizer``, so ``apply_chat_template(messages, add_generation_prompt=True)`` *is*
     ``encode_chat_completion`` — the v1 layout (system prompt in the first user turn, ``[INST]`` as text) and the
     v3 layout (system prompt in the last user turn, ``[INST]`` control tokens, tool calls) come from the same code
     that tokenized the training data, and a served prompt is the prefix the model was trained to continue.

Not a ``tokenizer.json`` with a Jinja chat template: transformers' conversion merges runs of spaces differently
from SentencePiece itself (docs/decisions.md, 'Exports carry the mistral-common tokenizer'). Serving stacks with a
Mistral tokenizer mode (vLLM ``--tokenizer-mode mistral``) read the same ``tokenizer.model.<version>`` file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from raytrain.dataset.tokenize import tokenizer_file

TOKENIZER_CONFIG = {"tokenizer_class": "MistralCommonBackend"}
"""``tokenizer_config.json`` of an export: AutoTokenizer resolves it to transformers' mistral-common wrapper."""


def save_hf_tokenizer(version: str, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer ``version`` ("v1" | "v3") into ``out_dir`` as files ``AutoTokenizer`` loads; returns it."""
    source = tokenizer_file(version)  # refuses unknown versions, names the choices
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, out_path / f"tokenizer.model.{version}")
    (out_path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    return out_path


__all__ = ["TOKENIZER_CONFIG", "save_hf_tokenizer"]
