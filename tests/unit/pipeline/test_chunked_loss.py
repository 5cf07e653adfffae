"""The chunked cross-entropy (raytrain.pipeline.model.causal_lm_loss) equals the one-shot fp32 loss and its
gradients, for fp32 and bf16 logits, with and without the feed's loss scale, chunks not dividing the tokens."""

import pytest
import torch
import torch.nn.functional as F

from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.pipeline.model import causal_lm_loss, over_chunks


def _reference(logits, labels, scale=None):
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss_sum = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    if scale is not None:
        return loss_sum * scale
    return loss_sum / (labels != IGNORE_INDEX).sum().clamp(min=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("recompute", [False, True])  # the CPU's default, an accelerator's
def test_chunked_loss_and_gradients_equal_the_one_shot_loss(dtype, scaled, recompute):
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 50, 97, generator=generator) * 4).to(dtype)  # 150 tokens: chunks of 16 leave 6
    labels = torch.randint(0, 97, (3, 50), generator=generator)
    labels[torch.rand(3, 50, generator=generator) < 0.4] = IGNORE_INDEX
    scale = torch.tensor(0.37) if scaled else None
    target = (labels, scale) if scaled else labels

    ours_in = logits.clone().requires_grad_(True)
    ours = causal_lm_loss(ours_in, target, chunk_tokens=16, recompute=recompute)
    ours.backward()
    ref_in = logits.clone().requires_grad_(True)
    ref = _reference(ref_in, labels, scale)
    ref.backward()

    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=0, atol=0)  # same chunk math, same gradients
    again = causal_lm_loss(logits, target, chunk_tokens=16, recompute=recompute)  # logits without gradients
    assert again == pytest.approx(float(ref.detach()), rel=1e-6)


def test_no_targets_gives_zero_not_nan():
    logits = torch.randn(2, 40, 11, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((2, 40), IGNORE_INDEX), chunk_tokens=16)
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(logits.grad) == 0


def _graph_nodes(loss: torch.Tensor) -> list[str]:
    seen, todo, names = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return names


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_assembles_the_logits_gradient_once(recompute):
    """The chunks are split views of the logits: one node gathers their gradients into the logits' gradient, where
    slices would each give a gradient of the logits' whole size, zero-filled and added up (benchmarks/bench_loss.py)."""
    logits = torch.randn(3, 50, 97, requires_grad=True)
    labels = torch.randint(0, 97, (3, 50))
    names = _graph_nodes(causal_lm_loss(logits, labels, chunk_tokens=16, recompute=recompute))
    assert names.count("SplitBackward0") == 1 and "SliceBackward0" not in names, names


@pytest.mark.parametrize("recompute", [False, True])
def test_chunks_are_recomputed_in_backward_only_when_asked(recompute):
    """Checkpointing (an accelerator's default) runs each chunk's function again in backward; on the CPU the
    chunks' tensors are kept and each chunk runs once."""
    calls = []

    def loss_sum(chunk, chunk_labels):
        calls.append(chunk.shape[0])
        return F.cross_entropy(chunk, chunk_labels, reduction="sum")

    logits = torch.randn(40, 11, requires_grad=True)
    sum(over_chunks(loss_sum, logits, torch.randint(0, 11, (40,)), chunk_tokens=16, recompute=recompute)).backward()
    assert calls == [16, 16, 8] + ([8, 16, 16] if recompute else []), calls
    assert logits.grad is not None and torch.count_nonzero(logits.grad) > 0
