"""Parameter roles: each helper sets and reads the attribute that megatron-core (or our code) reads,
under that exact name and with that default: megatron-core's DDP reads them by name."""
import torch

from megatron_dmoe.parallel import param_roles


def _param():
    return torch.nn.Parameter(torch.zeros(2, 3))


def test_expert_parallel_is_megatron_cores_allreduce():
    p = _param()
    assert not param_roles.is_expert_parallel(p)
    param_roles.mark_expert_parallel(p)
    assert param_roles.is_expert_parallel(p)
    assert not getattr(p, "allreduce", True)  # megatron-core DDP's own test for an expert parameter
    plain = _param()
    plain.allreduce = True  # as megatron-core may set it
    assert not param_roles.is_expert_parallel(plain)


def test_tensor_parallel_is_megatron_cores_attribute():
    p = _param()
    assert not param_roles.is_tensor_parallel(p)
    p.tensor_model_parallel = True  # what megatron-core's tensor-parallel layers set
    assert param_roles.is_tensor_parallel(p)


def test_our_roles_and_their_defaults():
    p = _param()
    assert (param_roles.main_grad_only(p), param_roles.fuses_wgrad_accumulation(p)) == (False, True)
    param_roles.set_main_grad_only(p, True)
    param_roles.set_fuse_wgrad_accumulation(p, False)
    assert (param_roles.main_grad_only(p), param_roles.fuses_wgrad_accumulation(p)) == (True, False)
    assert (p.main_grad_only, p.fuse_wgrad_accumulation) == (True, False)


def test_megatron_cores_gradient_buffer_attributes():
    p = _param()
    assert param_roles.main_grad(p) is None and not param_roles.zero_out_wgrad(p)
    p.main_grad = torch.zeros(2, 3)  # what megatron-core's DDP gives each parameter
    p.zero_out_wgrad = True  # what megatron-core sets on shared embeddings
    assert param_roles.main_grad(p) is p.main_grad and param_roles.zero_out_wgrad(p)
    for value in (True, False):
        param_roles.set_grad_added_to_main_grad(p, value)
        assert p.grad_added_to_main_grad is value  # DDP's hook reads it to skip its add
