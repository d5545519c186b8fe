"""model/linear.py: megatron's linear layers with the bias inside the matmul at tensor-parallel
size 1 give the same outputs and gradients as megatron's own (separate bias add) path."""
import pytest
import torch

from megatron_dmoe.model.linear import FusedBiasColumnLinear, FusedBiasRowLinear

YAML = ("model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 8, vocab_size: 50}\n"
        "training: {micro_batch_size: 2, global_batch_size: 2}\n")


def _model(cpu_dist, tmp_path, *overrides):
    from megatron_dmoe.config import load_config, resolve, validate
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import seed_everything

    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    cfg = resolve(load_config(str(path), list(overrides)))
    validate(cfg, world_size=1)
    seed_everything(5, cpu_dist)
    return build_gpt_model(cfg, vocab_size=50, on_cuda=False)


def _loss_and_grads(model, fuse):
    linears = [m for m in model.modules() if isinstance(m, (FusedBiasColumnLinear, FusedBiasRowLinear))]
    for m in linears:
        m.fuse_bias = fuse
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (2, 9), generator=g)
    positions = torch.arange(8).expand(2, 8)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
    loss.sum().backward()
    return linears, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_dense_gpt_same_loss_and_gradients_as_megatrons_linears(cpu_dist, tmp_path):
    for overrides in ((), ("model.activation=swiglu",)):
        model = _model(cpu_dist, tmp_path, *overrides)
        with torch.no_grad():  # non-zero biases, so that where they are added matters
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
        linears, loss0, grads0 = _loss_and_grads(model, fuse=False)
        # attention's qkv and projection, the MLP's fc1 and fc2, in each of the two layers
        assert len(linears) == 8 and all(m.bias is not None for m in linears)
        _, loss1, grads1 = _loss_and_grads(model, fuse=True)
        torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
        for name in grads0:
            torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bias_is_added_inside_and_not_returned(cpu_dist, tmp_path):
    """Under skip_bias_add megatron returns the bias for the caller to add; fused, the output
    already holds it and the returned bias is None."""
    model = _model(cpu_dist, tmp_path)
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert isinstance(fc1, FusedBiasColumnLinear) and fc1.skip_bias_add
    with torch.no_grad():
        fc1.bias.normal_()
    x = torch.randn(3, 2, 32)
    out, bias = fc1(x)
    assert bias is None
    fc1.fuse_bias = False
    plain, plain_bias = fc1(x)
    assert plain_bias is fc1.bias
    torch.testing.assert_close(out, plain + plain_bias)


def test_fp8_linears_train_close_to_the_plain_ones(cpu_dist, tmp_path):
    """training.fp8: attention's and the dense MLP's linears become Fp8*Linear (the configuration
    check refuses fp8 on CPU, so the model is built past it); their block-scaled fp8 products (the
    pure-torch reference on CPU) give the loss and gradients of the plain model within the recipe's
    error, and not exactly."""
    from megatron_dmoe.model.linear import Fp8ColumnLinear, Fp8RowLinear

    plain = _model(cpu_dist, tmp_path)
    _, loss0, grads0 = _loss_and_grads(plain, fuse=True)
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import seed_everything

    cfg = resolve(load_config(str(tmp_path / "run.yaml"), []))
    cfg.training.fp8 = "blockwise"
    seed_everything(5, cpu_dist)
    fp8 = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
    linears = [m for m in fp8.modules() if isinstance(m, (Fp8ColumnLinear, Fp8RowLinear))]
    assert len(linears) == 8
    _, loss1, grads1 = _loss_and_grads(fp8, fuse=True)
    assert 0 < float((loss1 - loss0).abs().max()) < 0.02 * float(loss0.abs().max())
    for name in grads0:
        if not any(f".{kind}." in name for kind in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
            continue
        err = float((grads1[name] - grads0[name]).norm() / grads0[name].norm())
        assert err < 0.1, (name, err)


def test_fp8_and_bf16_models_hold_the_same_state(cpu_dist, tmp_path):
    """fp8 keeps no state of its own (weights are quantized as they are read): the fp8 model's
    parameters, buffers and sharded checkpoint entries are the plain model's, so a checkpoint of
    either loads into the other."""
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import seed_everything

    plain = _model(cpu_dist, tmp_path)
    cfg = resolve(load_config(str(tmp_path / "run.yaml"), []))
    cfg.training.fp8 = "blockwise"
    seed_everything(6, cpu_dist)
    fp8 = build_gpt_model(cfg, vocab_size=50, on_cuda=False)

    def shapes(model):
        return {k: None if v is None else tuple(v.shape) for k, v in model.state_dict().items()}

    assert shapes(fp8) == shapes(plain)
    sharded = [{k: tuple(v.local_shape) for k, v in m.sharded_state_dict().items() if hasattr(v, "local_shape")}
               for m in (plain, fp8)]
    assert sharded[0] == sharded[1] and sharded[0]
    fp8.load_state_dict(plain.state_dict())
    for (name, a), (_, b) in zip(plain.state_dict().items(), fp8.state_dict().items()):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_fp8_reaches_the_moe_layers(cpu_dist, tmp_path):
    """training.fp8 in a dMoE GPT: the MoE layers take it (their experts' products in fp8, through
    Triton's interpreter on CPU) beside the fp8 linears; the loss is the plain model's within the
    recipe's error, and not exactly it."""
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.moe import MoELayer
    from megatron_dmoe.parallel.distributed import seed_everything

    path = tmp_path / "run.yaml"
    path.write_text(YAML + "moe: {num_experts: 4, top_k: 2, ffn_hidden_size: 64, block_size: 32, backend: sparse}\n")
    losses = []
    for fp8 in (None, "blockwise"):
        cfg = resolve(load_config(str(path), []))
        cfg.training.fp8 = fp8
        seed_everything(5, cpu_dist)
        model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        assert layers and all(m.experts.options.fp8 == fp8 for m in layers)
        _, loss, grads = _loss_and_grads(model, fuse=True)
        losses.append(loss)
        assert all(torch.isfinite(g).all() for g in grads.values())
    gap = float((losses[1] - losses[0]).abs().max() / losses[0].abs().max())
    assert 0 < gap < 0.02, gap
