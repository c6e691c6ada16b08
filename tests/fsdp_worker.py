"""One rank of the two-process FSDP2 check of ``tests/tooling/test_distributed.py`` (not a test module).

Started twice by the test with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set (CPU,
gloo). For each family it builds the same seeded tiny model in float64 on both ranks, shards it
as transformers/accelerate do with FSDP2 (``fully_shard`` on every ``_no_split_modules`` layer,
then on the root), trains a few AdamW steps with each rank on its half of a fixed batch, and
trains an unsharded copy on the same data in one process (the two halves' losses averaged, which
is what FSDP2's averaged gradient reduction computes). It then gathers the full state dict
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), saves it with
``save_pretrained`` (safetensors) and reloads it. Rank 0 writes one JSON result per family to
the file given as the first argument.

Usage: ``python tests/fsdp_worker.py RESULT.json OUT_DIR FAMILY [FAMILY ...]``.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import (  # noqa: E402
    V_BERT,
    V_GPT,
    tiny_linear_gpt_config,
    tiny_nprf_bert_config,
    tiny_relative_performer_vit_config,
)
from tests.process_group_exit import end_process_group  # noqa: E402

STEPS = 3
LR = 1e-2
BATCH = 4  # global batch; each of the 2 ranks takes 2 rows
N = 16


def family(name: str):
    """(model class, config, fixed global batch) of one family."""
    from hf_kernattn import LinearGPTForCausalLM, NPRFBertForMaskedLM, RelativePerformerViTForImageClassification

    g = torch.Generator().manual_seed(1234)
    if name == "nprf_bert":
        config = tiny_nprf_bert_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        ids = torch.randint(1, V_BERT, (BATCH, N), generator=g)
        labels = torch.where(torch.rand(BATCH, N, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]  # every row has at least one masked-LM target
        return NPRFBertForMaskedLM, config, {"input_ids": ids, "labels": labels}
    if name == "linear_gpt":
        config = tiny_linear_gpt_config()
        ids = torch.randint(1, V_GPT, (BATCH, N), generator=g)
        return LinearGPTForCausalLM, config, {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    if name == "relative_performer_vit":
        config = tiny_relative_performer_vit_config()
        pixels = torch.randn(BATCH, 1, 16, 16, generator=g, dtype=torch.float64)
        labels = torch.randint(0, 3, (BATCH,), generator=g)
        return RelativePerformerViTForImageClassification, config, {"pixel_values": pixels, "labels": labels}
    raise ValueError(f"unknown family {name!r}")


def rows(batch: dict, part: slice) -> dict:
    return {k: v[part] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run(name: str, out_dir: Path, rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    cls, config, batch = family(name)
    torch.manual_seed(0)
    model = cls(config).to(torch.float64).train()
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    halves = [slice(i * BATCH // world, (i + 1) * BATCH // world) for i in range(world)]

    # the single-process run: the mean of the halves' losses (what averaged gradients compute)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_losses = []
    for _ in range(STEPS):
        total = 0.0
        for part in halves:
            loss = reference(**rows(batch, part)).loss / world
            loss.backward()
            total += loss.item()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)

    # the sharded run, as accelerate/transformers wrap with FSDP2
    layers = set(model._no_split_modules)
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(**rows(batch, halves[rank])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone() / world
        dist.all_reduce(mean)
        losses.append(mean.item())

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result: dict = {"family": name, "ok": True}
    if rank == 0:
        ref_state = reference.state_dict()
        result["keys_equal"] = sorted(full) == sorted(ref_state)
        result["max_param_diff"] = max((full[k] - ref_state[k]).abs().max().item() for k in ref_state if k in full)
        result["max_change"] = max((ref_state[k] - initial[k]).abs().max().item() for k in ref_state
                                   if ref_state[k].is_floating_point())
        result["losses"], result["ref_losses"] = losses, ref_losses
        path = out_dir / name
        model.save_pretrained(path, state_dict=dict(full))  # save_pretrained empties the dict it gets
        result["files"] = sorted(p.name for p in path.iterdir())
        reference.save_pretrained(out_dir / f"{name}_single")  # the same weights saved without sharding
        with safe_open(path / "model.safetensors", "pt") as a, safe_open(out_dir / f"{name}_single" / "model.safetensors", "pt") as b:
            result["saved_keys_extra"] = sorted(set(a.keys()) - set(b.keys()))
            result["saved_keys_missing"] = sorted(set(b.keys()) - set(a.keys()))
        loaded = cls.from_pretrained(path, dtype=torch.float64)
        loaded_state = loaded.state_dict()
        result["reload_missing"] = sorted(set(full) - set(loaded_state))
        result["reload_extra"] = sorted(set(loaded_state) - set(full))
        result["reload_mismatch"] = sorted(k for k in full if k in loaded_state and not torch.equal(loaded_state[k], full[k]))
        with torch.no_grad():
            loaded.eval(), reference.eval()
            a, b = loaded(**rows(batch, slice(None))).logits, reference(**rows(batch, slice(None))).logits
        result["max_logit_diff"] = (a - b).abs().max().item()
    dist.barrier()
    return result


def main() -> None:
    result_file, out_dir, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            results[name] = run(name, out_dir, rank, world)
        except Exception as err:  # reported per family; the other families still run
            results[name] = {"family": name, "ok": False, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()[-3000:]}
            dist.barrier()
    if rank == 0:
        result_file.write_text(json.dumps(results, indent=1))
    end_process_group()  # closed before exit: tests/process_group_exit.py


if __name__ == "__main__":
    main()
