"""In-process checks of the overlapped data-parallel reduction (run by test_overlap_grad_reduce.py in
two gloo processes): the wrapper's buckets, the schedule's hooks, and reductions issued during backward."""
import torch
import torch.distributed as dist


def reductions_start_during_backward() -> None:
    """wrap_for_training(overlap_grad_reduce=True, bucket_size=40) on a module of four linears: several
    buckets; the model config carries the wrapper's no_sync; the earlier micro-batches of a step issue
    no reduction; in the last one's backward every bucket's reduction is issued before
    finish_grad_sync; the reduced gradients are the two ranks' summed gradients (computed here by
    hand with an all-reduce of the plain autograd gradients), divided by 2."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_model_config

    from megatron_dmoe.compat.cpu import apply_cpu_compat
    from megatron_dmoe.training.setup import wrap_for_training

    apply_cpu_compat()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, n) for n in (3, 11, 13, 7))

        def forward(self, x):
            return sum(layer(x).square().sum() for layer in self.layers)

    torch.manual_seed(0)
    plain = Tiny()
    model = wrap_for_training(Tiny(), overlap_grad_reduce=True, bucket_size=40)
    model.module.load_state_dict(plain.state_dict())
    assert len(model.bucket_groups) > 1
    assert get_model_config(model).no_sync_func == model.no_sync
    rank = dist.get_rank()
    for step in range(3):
        inputs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + 10 * rank + m))
                  for m in range(2)]
        model.zero_grad_buffer()
        with model.no_sync():
            model(inputs[0]).backward()
        assert all(group.grad_reduce_handle is None for group in model.bucket_groups)
        model(inputs[1]).backward()
        if step > 0:  # the first step learns how many gradients each bucket waits for
            assert all(group.grad_reduce_handle is not None for group in model.bucket_groups)
        model.finish_grad_sync()
        plain.zero_grad()
        sum(plain(x) for x in inputs).backward()
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            expected = q.grad.clone()
            dist.all_reduce(expected)
            torch.testing.assert_close(p.main_grad, expected / dist.get_world_size(), rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"step {step} {name}: {m}")
