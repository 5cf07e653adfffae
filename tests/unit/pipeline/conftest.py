"""A single-process gloo group for the DeepSpeed engine tests of this folder."""

import os
import socket

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_group():
    """One single-process gloo group per module that asks (DeepSpeed picks its CPU accelerator without a GPU),
    destroyed at the module's end: other modules in the same process start process groups of their own."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    created = not torch.distributed.is_initialized()
    if created:
        from raytrain.pipeline.engine import init_distributed

        init_distributed("gloo")  # raytrain's, as the trainer workers call it
    yield
    if created:
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
