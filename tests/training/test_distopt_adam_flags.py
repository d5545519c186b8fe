"""How torch's Adam runs its update survives a distributed-optimizer load (compat/distopt_adam_step.py):
megatron-core's load takes every parameter group whole from the checkpoint, which rank 0 wrote;
the fused flag and the step counters on the parameters' device must be this process's again.
torch's fused AdamW runs on CPU too, so all of it is checked here; on two GPUs,
tests/parallel/test_two_gpu_distopt_resume.py."""
import copy
import types

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_dmoe.compat.distopt_adam_step import keep_restored_adam_state, restore_implementation_flags


def _fused_adamw(seed):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    return params, torch.optim.AdamW(params, lr=1e-2, foreach=False, fused=True)


def _one_step(params, adam):
    for p in params:
        p.grad = torch.randn_like(p)
    adam.step()


def _saved_by_a_multi_tensor_rank(adam):
    """adam's state dict as a rank running torch's multi-tensor Adam would have written its groups."""
    saved = copy.deepcopy(adam.state_dict())  # a load would share the moments' tensors otherwise
    for group in saved["param_groups"]:
        group["fused"], group["foreach"] = None, None
    return saved


def test_restored_flags_put_the_step_where_the_fused_kernel_reads_it():
    params, adam = _fused_adamw(0)
    _one_step(params, adam)
    flags = [{"fused": g["fused"], "foreach": g["foreach"]} for g in adam.param_groups]
    saved = _saved_by_a_multi_tensor_rank(adam)

    other_params, other = _fused_adamw(1)
    with torch.no_grad():
        for p, q in zip(other_params, params):
            p.copy_(q)
    other.load_state_dict(saved)
    assert other.param_groups[0]["fused"] is None  # what a load does alone
    restore_implementation_flags(other, flags)
    assert all(g["fused"] is True and g["foreach"] is False for g in other.param_groups)
    steps = [other.state[p]["step"] for p in other_params]
    assert all(s.dtype == torch.float32 and s.device == p.device for s, p in zip(steps, other_params))
    assert steps[0].data_ptr() != steps[1].data_ptr()  # each parameter counts its own steps

    # the fused kernel takes the folded clip's grad_scale again, and steps as the uninterrupted Adam
    torch.manual_seed(7)
    other.grad_scale = torch.tensor(2.0)
    for p in other_params:
        p.grad = torch.randn_like(p)
    other.step()
    del other.grad_scale
    torch.manual_seed(7)
    for p in params:
        p.grad = torch.randn_like(p) / 2.0
    adam.step()
    for p, q in zip(other_params, params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert float(other.state[other_params[0]]["step"]) == 2.0


def test_distributed_optimizer_load_keeps_this_process_flags(monkeypatch):
    params, adam = _fused_adamw(0)
    _one_step(params, adam)
    saved = _saved_by_a_multi_tensor_rank(adam)

    def megatron_like_load(self, state_dict):  # groups whole from the checkpoint, as megatron-core's
        self.optimizer.load_state_dict(state_dict)
        return "loaded"

    monkeypatch.setattr(DistributedOptimizer, "load_state_dict", megatron_like_load)
    monkeypatch.setattr(DistributedOptimizer, "_set_main_param_and_optimizer_states",
                        DistributedOptimizer._set_main_param_and_optimizer_states)  # put back after the test
    keep_restored_adam_state()
    keep_restored_adam_state()  # idempotent: one wrapper
    assert DistributedOptimizer.load_state_dict.__wrapped__ is megatron_like_load

    other_params, other = _fused_adamw(1)
    assert DistributedOptimizer.load_state_dict(types.SimpleNamespace(optimizer=other), saved) == "loaded"
    assert all(g["fused"] is True for g in other.param_groups)
    assert all(other.state[p]["step"].dtype == torch.float32 for p in other_params)

