import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path):
    """A real one-rank gloo process group for the loop's barriers and collectives."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
