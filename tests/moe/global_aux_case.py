"""The global aux loss of one training step against the Switch loss over the whole global batch at
once (the float64 reference on every token of every micro-batch and rank)."""
import torch

from megatron_dmoe.moe import MoELayer, reset_global_load_balance
from moe_reference import make_config, reference_moe

HIDDEN, FFN, E, K, COEFF = 8, 8, 6, 2, 0.1


def build_layer(seed=0):
    config = make_config(HIDDEN, FFN, E, K, moe_aux_loss_coeff=COEFF, moe_router_load_balancing_type="global_aux_loss")
    torch.manual_seed(seed)
    layer = MoELayer(config, backend="reference").train()
    with torch.no_grad():  # logits of order 1, so that the experts' loads differ
        layer.router.weight.normal_(0.0, 1.0 / HIDDEN**0.5)
    return layer


def draw_tokens(seed, s, b):
    return torch.randn(s, b, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def step_loss(layer, micro_batches, paddings=None):
    """Run the micro-batches [s, b_i, h] through the layer as one training step; the step's loss."""
    reset_global_load_balance(layer)
    for i, x in enumerate(micro_batches):
        layer(x.clone().requires_grad_(), padding_mask=None if paddings is None else paddings[i])
    return layer.router.global_load.step_loss(K, COEFF)


def whole_batch_loss(layer, tokens):
    """The reference's load-balancing loss over tokens [T, h] at once."""
    w = layer.router.weight.detach()
    dummy = torch.zeros(E, FFN, HIDDEN, dtype=torch.float64)
    _, aux, _ = reference_moe(tokens, w, dummy, dummy, dummy, top_k=K, aux_coeff=COEFF)
    return aux


def split_by_sequences(x, sizes):
    """x [s, b, h] -> micro-batches of `sizes` sequences each."""
    assert sum(sizes) == x.shape[1]
    return list(torch.split(x, sizes, dim=1))


def check_two_ranks() -> None:
    """In 2 gloo processes: every rank's step loss is the loss over both ranks' tokens at once, with
    a different split (same number of micro-batches) on each rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    layer = build_layer()
    xs = [draw_tokens(100 + r, 4, 6) for r in range(2)]
    splits = ([2, 4], [5, 1])
    loss = step_loss(layer, split_by_sequences(xs[rank], splits[rank]))
    everything = torch.cat([x.reshape(-1, HIDDEN) for x in xs])
    expected = whole_batch_loss(layer, everything)
    alone = whole_batch_loss(layer, xs[rank].reshape(-1, HIDDEN))
    assert abs(float(loss) - float(expected)) < 1e-12 * float(expected), (rank, float(loss), float(expected))
    assert abs(float(alone) - float(expected)) > 1e-6, "the ranks' tokens alone must give another loss"
