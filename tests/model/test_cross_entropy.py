"""The fused language-model cross-entropy (dmoe_kernels.loss) against a float64 torch
reference: losses and logit gradients, on CPU through Triton's interpreter (fp32, fp16) and in
bf16 on a GPU; and inside the GPT model, against megatron-core's own loss."""
import pytest
import torch

from dmoe_kernels import reference as ref
from dmoe_kernels.loss.functional import BLOCK_V, fused_cross_entropy


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 2e-3), torch.bfloat16: (2e-5, 2e-2)}


def _check(logits, labels, inplace_backward=False, grad_tol=None):
    """Loss and gradient of a random weighting of the losses, against float64."""
    g = torch.Generator().manual_seed(labels.numel())
    weights = torch.rand(labels.shape, generator=g).to(logits.device)
    wide = logits.detach().double().requires_grad_()
    expected = ref.cross_entropy(wide, labels)
    (expected * weights.double()).sum().backward()
    x = logits.detach().clone().requires_grad_()
    leaf_values = x.detach().clone()
    got = fused_cross_entropy(x * 1 if inplace_backward else x, labels, inplace_backward=inplace_backward)
    assert got.dtype == torch.float32 and got.shape == labels.shape
    (got * weights).sum().backward()
    loss_tol, default_grad_tol = TOLERANCE[logits.dtype]
    grad_tol = grad_tol or default_grad_tol
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < loss_tol
    grad_err = float((x.grad.double() - wide.grad).norm() / wide.grad.norm())
    assert grad_err < grad_tol, grad_err
    # the leaf keeps its values: only an intermediate's storage is ever overwritten
    assert torch.equal(x.detach(), leaf_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,vocab", [((5,), 37), ((3, 2), BLOCK_V + 3), ((2, 4), 2 * BLOCK_V)],
                         ids=["one-chunk", "partial-chunk", "two-chunks"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_matches_float64_reference(dtype, shape, vocab, inplace, device):
    g = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(*shape, vocab, generator=g)).to(dtype).to(device)
    labels = torch.randint(0, vocab, shape, generator=g).to(device)
    labels.view(-1)[0] = vocab - 1  # the last column, at a chunk's masked edge
    _check(logits, labels, inplace)


def test_large_logits_do_not_overflow(device):
    """The running maximum keeps exp() finite for logits far beyond exp's range (fp32 resolves
    logits of 1000 to about 6e-5, hence the looser gradient tolerance)."""
    logits = torch.tensor([[1000.0, 990.0, -1000.0], [-500.0, -510.0, -505.0]], device=device)
    labels = torch.tensor([1, 2], device=device)
    _check(logits, labels, grad_tol=1e-4)


def test_strided_logits_and_labels(device):
    """[s, b, V] logits with [b, s] labels transposed, as the language model passes them."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3, 70, generator=g).to(device)
    labels = torch.randint(0, 70, (3, 6), generator=g).to(device)
    _check(logits, labels.transpose(0, 1))


def test_argument_errors(device):
    logits = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match="must agree on every dimension but the last"):
        fused_cross_entropy(logits, torch.zeros(5, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="labels must be integers"):
        fused_cross_entropy(logits, torch.zeros(4, device=device))
    with pytest.raises(TypeError, match="logits must be float32, float16 or bfloat16"):
        fused_cross_entropy(logits.double(), torch.zeros(4, dtype=torch.long, device=device))


@pytest.mark.gpu
def test_bf16_on_gpu_with_a_gpt_sized_vocabulary():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(512, 50304, generator=g)).to(torch.bfloat16).cuda()
    labels = torch.randint(0, 50257, (512,), generator=g).cuda()
    _check(logits, labels)
    _check(logits, labels, inplace_backward=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model: the kernels run through Triton's interpreter, "
                    "which the suite turns on only where there is no GPU")
def test_gpt_model_loss_matches_megatrons(cpu_dist, tmp_path):
    """The same model, weights and batch: our fused loss and megatron-core's unfused one give the
    same per-token losses and the same gradients for every parameter (the wiring: [b, s] labels
    against [s, b, V] logits, and the in-place gradient)."""
    from megatron_dmoe.config import load_config, resolve, validate
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import seed_everything

    path = tmp_path / "run.yaml"
    path.write_text("model: {num_layers: 1, hidden_size: 32, num_attention_heads: 4, seq_length: 8, vocab_size: 50}\n"
                    "training: {micro_batch_size: 2, global_batch_size: 2}\n")
    cfg = resolve(load_config(str(path), []))
    validate(cfg, world_size=1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (2, 9), generator=g)
    positions = torch.arange(8).expand(2, 8)
    results = []
    for fused in (False, True):
        seed_everything(3, cpu_dist)
        model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
        model.triton_cross_entropy = fused
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    assert loss1.shape == (2, 8)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-6, msg=name)
