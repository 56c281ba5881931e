"""DDP models under torch.distributed.checkpoint's state-dict helpers.

get_state_dict / set_state_dict name a torch DDP model's parameters without DDP's "module."
prefix, in the model's state and in the optimizer's; dptc's DDP must get the same names
(see [Note: wrappers in torch.distributed.checkpoint] in dptc/_dcp.py), so that a checkpoint
written with dcp.save under one wrapper loads under the other and into the unwrapped model.  Two ranks train
torch's DDP and dptc's side by side on the same batches; the test checks the names, then that
torch's checkpoint, loaded into a fresh dptc DDP, resumes to torch's parameters bit for bit, and
that dptc's checkpoint loads into a plain model.  Run twice: with the checkpoint module imported
before dptc's DDP, and after (dptc then rebinds its name on import).

The rank-side body is the function at the bottom of this file (run by tests/_rank.py).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._launch import run_ranks


@pytest.mark.parametrize("dcp_first", [True, False], ids=["dcp-imported-first",
                                                         "dcp-imported-after"])
def test_dcp_state_dict_names_and_resume(tmp_path, dcp_first):
    results = run_ranks("tests.test_ddp_checkpoint:dcp_case", 2, timeout=120,
                        args={"path": str(tmp_path), "dcp_first": dcp_first})
    for rank, result in enumerate(results):
        assert result["ddp_is_recognised"], (rank, result)
        assert result["model_keys"]["dptc"] == result["model_keys"]["torch"], (rank, result)
        assert not any(key.startswith("module.") for key in result["model_keys"]["dptc"]), result
        assert result["optim_keys"]["dptc"] == result["optim_keys"]["torch"], (rank, result)
        assert result["optim_params"]["dptc"] == result["optim_params"]["torch"], (rank, result)
        assert result["trained_diff"] == 0.0, (rank, result)
        assert result["loaded_diff"] == 0.0, (rank, result)
        assert result["resumed_diff"] == 0.0, (rank, result)
        assert result["plain_diff"] == 0.0, (rank, result)
        # The resumed run moved: the comparison after it is not of untouched weights.
        assert result["resume_moved"] > 1e-6, (rank, result)


# ---------------------------------------------------------------------------------------------
# Rank side

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _step(model, optimizer, step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(6, 8, generator=generator)
    labels = torch.randint(4, (6,), generator=generator)
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


def _max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def dcp_case(path, dcp_first):
    import importlib
    import os
    if dcp_first:
        importlib.import_module("torch.distributed.checkpoint.state_dict")
    from dptc import DistributedDataParallel as DptcDDP
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import dptc
    from tests._rank import load_impl
    load_impl("torch")
    rank = int(os.environ["RANK"])

    def build(wrapper):
        torch.manual_seed(0)
        model = wrapper(_Net())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    models = {"torch": build(TorchDDP), "dptc": build(DptcDDP)}
    for step in range(3):
        for model, optimizer in models.values():
            _step(model, optimizer, step, rank)
    result = {"ddp_is_recognised": isinstance(models["dptc"][0], dsd.DDP),
              "trained_diff": _max_diff(models["torch"][0], models["dptc"][0]),
              "model_keys": {}, "optim_keys": {}, "optim_params": {}}
    states = {}
    for name, (model, optimizer) in models.items():
        model_state, optim_state = dsd.get_state_dict(model, optimizer)
        states[name] = {"model": model_state, "optim": optim_state}
        result["model_keys"][name] = list(model_state)
        result["optim_keys"][name] = sorted(optim_state["state"])
        result["optim_params"][name] = [group["params"] for group in optim_state["param_groups"]]
    for name, state in states.items():
        dcp.save(state, checkpoint_id=os.path.join(path, name))
    dist.barrier()

    # torch's checkpoint into a fresh dptc DDP, which then trains on beside torch's.
    fresh, fresh_optimizer = build(DptcDDP)
    model_state, optim_state = dsd.get_state_dict(fresh, fresh_optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=os.path.join(path, "torch"))
    dsd.set_state_dict(fresh, fresh_optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
    result["loaded_diff"] = _max_diff(models["torch"][0], fresh)
    before = [p.detach().clone() for p in fresh.parameters()]
    for step in range(3, 5):
        _step(models["torch"][0], models["torch"][1], step, rank)
        _step(fresh, fresh_optimizer, step, rank)
    result["resumed_diff"] = _max_diff(models["torch"][0], fresh)
    result["resume_moved"] = max((p.detach() - b).abs().max().item()
                                 for p, b in zip(fresh.parameters(), before))

    # dptc's checkpoint into the unwrapped model.
    plain = _Net()
    plain_state = dsd.get_model_state_dict(plain)
    dcp.load({"model": plain_state}, checkpoint_id=os.path.join(path, "dptc"))
    dsd.set_model_state_dict(plain, plain_state)
    result["plain_diff"] = max((p.detach() - q.detach()).abs().max().item()
                               for p, q in zip(plain.parameters(),
                                               models["dptc"][0].module.parameters()))
    # (dptc's trained copy took no step since it was saved.)
    dptc.destroy_process_group()
    dist.destroy_process_group()
    return result
