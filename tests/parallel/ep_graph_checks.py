"""Checks run in every process of a 2-GPU group: the expert-parallel layer over the symmetric (or
the NVSHMEM) exchange reads nothing on the host, so it runs under torch's sync-debug "error" mode and captures
as one CUDA graph whose replays equal eager calls."""
import torch

from ep_layer_checks import _build, _draw_tokens, _draw_weights
from megatron_dmoe.moe import AuxLossScaler
from megatron_dmoe.parallel.distributed import init_distributed
from moe_reference import rel_err

HIDDEN, FFN = 64, 128
CASE = dict(ep=2, E=4, k=2, aux=0.05, z=0.01, backend="sparse", exchange="symmetric")


def _layer_and_tokens(dtype, exchange):
    init_distributed("cuda", expert_model_parallel_size=CASE["ep"])
    AuxLossScaler.set_loss_scale(1.0)
    case = dict(CASE, exchange=exchange)
    layer = _build(case, case["ep"], dtype, _draw_weights(case, 0, dtype, HIDDEN, FFN), 1, HIDDEN, FFN, "cuda")
    x, out_grad, _ = _draw_tokens(0, torch.distributed.get_rank(), dtype, HIDDEN, "cuda")
    return layer, x.requires_grad_(), out_grad


def _step(layer, x, out_grad):
    out, _ = layer(x)
    out.backward(out_grad)
    return out


def check_no_host_sync(exchange: str = "symmetric") -> None:
    layer, x, out_grad = _layer_and_tokens(torch.bfloat16, exchange)
    _step(layer, x, out_grad)  # compiles the kernels and allocates the exchange's buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            _step(layer, x, out_grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def check_graph_replay_equals_eager(exchange: str = "symmetric") -> None:
    """Forward and backward captured together; each replay gives the eager output, input gradient and
    parameter gradients (accumulated into the same .grad tensors as eager calls would)."""
    layer, x, out_grad = _layer_and_tokens(torch.float32, exchange)
    params = [p for p in layer.parameters() if p.requires_grad]

    def clear():
        x.grad = None
        for p in params:
            p.grad = None

    clear()
    eager_out = _step(layer, x, out_grad).detach().clone()
    eager = [x.grad.clone()] + [p.grad.clone() for p in params]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            clear()
            _step(layer, x, out_grad)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = _step(layer, x, out_grad)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(graph_out, eager_out) < 1e-5
        for got, want in zip([x.grad] + [p.grad for p in params], eager):
            assert rel_err(got, want) < 1e-5
    del graph
