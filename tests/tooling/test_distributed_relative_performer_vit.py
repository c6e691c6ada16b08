"""The relative-performer ViT under torch FSDP2 with ``fully_shard`` on every layer and on the
root (2 CPU processes, gloo): each parameter is read only inside the forward of the module that
owns it (FSDP2 gathers a module's parameters only around that forward), and two training steps
give the parameters of the same steps in one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from hf_kernattn import RelativePerformerViTForImageClassification

from tests.conftest import tiny_relative_performer_vit_config as tiny

STEPS, LR = 2, 0.5


def _data():
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(4, 1, 16, 12, dtype=torch.float64, generator=gen)
    mask = torch.ones(4, 4, 3, dtype=torch.long)
    mask[1, 3:] = 0
    labels = torch.tensor([0, 2, 1, 1])
    return pixels, mask, labels


def _model(**overrides):
    torch.manual_seed(0)
    cfg = tiny(hidden_dropout_prob=0.0, feature_redraw_interval=0, **overrides)
    return RelativePerformerViTForImageClassification(cfg).double().train()


def _train(model, pixels, mask, labels):
    """STEPS of SGD on the mean loss of the batch given."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        model(pixel_values=pixels, patch_mask=mask, labels=labels).loss.backward()
        opt.step()


def _shard_train_save(rank: int, out: str, overrides: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model(**overrides)
    for layer in model.vit.layers:
        fully_shard(layer)
    fully_shard(model)
    pixels, mask, labels = _data()
    part = slice(2 * rank, 2 * rank + 2)  # each rank its half; FSDP2 averages the gradients
    _train(model, pixels[part], mask[part], labels[part])
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, out)


def _worker(rank: int, world: int, port: int, out: str, overrides: dict) -> None:
    import torch.distributed as dist

    from tests.process_group_exit import end_process_group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _shard_train_save(rank, out, overrides)  # its sharded model is gone when it returns
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other rank may never reach it
        raise
    end_process_group()  # closed before exit: tests/process_group_exit.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("overrides", [dict(rpe="learned_2d", pooling="cls")])
def test_fully_shard_per_layer_trains_like_one_process(tmp_path, overrides):
    """Per-layer and root ``fully_shard`` on 2 gloo processes, each with half of a batch of 4
    (one image with padded patches), 2 SGD steps: the full state dict equals 2 steps on the
    whole batch in one process. float64; the runs differ only in how the gradient mean is
    summed (two half-batch means averaged vs one mean of 4), ~1e-16 relative per step, so 1e-10
    absolute on parameters of size ~1 is far above rounding and far below any real difference
    (one step moves them by ~1e-2)."""
    pytest.importorskip("torch.distributed.fsdp")
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = str(tmp_path / "fsdp.safetensors")
    mp.spawn(_worker, args=(2, _free_port(), out, overrides), nprocs=2, join=True)
    got = load_file(out)

    model = _model(**overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, *_data())
    want = model.state_dict()
    assert set(got) == set(want)
    moved = max(float((want[k] - before[k]).abs().max()) for k in want if want[k].is_floating_point())
    assert moved > 1e-3  # the steps really changed the parameters
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10, msg=name)
