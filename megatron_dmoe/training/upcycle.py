"""Upcycling: an MoE run that starts from a dense run's checkpoint (checkpoint.upcycle_from).

The dense model this run's config describes (the same config with moe.num_experts 0) is built and
its checkpoint loaded through the usual dist_checkpointing path, so the dense run may have had any
parallel layout. Then every weight with the same name and shape is copied (embeddings, attention,
norms, output layer), and each MoE layer's experts are made from the dense layer's MLP:

  * granularity 1: every expert is a copy of the dense MLP;
  * granularity N (moe.upcycle_granularity): the dense MLP is split along its ffn dimension into N
    pieces of width ffn / N (the dense MLP is the sum of its pieces), and expert e is piece e mod N,
    megatron-core's upcycling_utils layout.

Expert outputs are scaled, through w2 only (the output is linear in it, whatever the activation),
as megatron-core's upcycling_utils scales the activation, divided by the router's
topk_scaling_factor: N when each token's top-k weights sum to 1 (renormalised, or softmax after
top-k), E * N / top_k for raw probabilities. With granularity 1 and weights that sum to 1, the
MoE layer computes exactly the dense MLP at step 0. The router is initialised as usual; shared
experts start with w2 = 0 (they add nothing until trained), so they do not change that output.

Experts have no biases: a dense MLP with non-zero biases cannot be upcycled exactly and is refused
(train the dense run with model.add_bias_linear: false).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import List, Optional

import torch

from megatron_dmoe.config import RunConfig
from megatron_dmoe.moe.layer import MoELayer
from megatron_dmoe.training.checkpoint import (
    CheckpointError,
    _unwrap,
    load_checkpoint,
)
from megatron_dmoe.training.load_source import named_checkpoint
from megatron_dmoe.training.run_dir import CONFIG_FILE

KEY = "checkpoint.upcycle_from"


class UpcycleError(CheckpointError):
    pass


def dense_checkpoint_path(source) -> Path:
    """The checkpoint directory `source` names: a run directory, its checkpoints/ folder (newest
    complete checkpoint), or one iter_N checkpoint."""
    try:
        return named_checkpoint(source, KEY, "the dense run")
    except CheckpointError as err:
        raise UpcycleError(str(err)) from None


def _dense_config(cfg: RunConfig) -> RunConfig:
    dense = copy.deepcopy(cfg)
    dense.moe.num_experts = 0
    dense.parallel.expert_model_parallel_size = 1  # no experts to spread: megatron refuses EP > 1
    return dense


def _check_dense_run_config(source: Path, cfg: RunConfig) -> None:
    """Name the model.* keys where the dense run (its saved config.yaml, when there is one) differs."""
    for candidate in (source, source.parent, source.parent.parent):
        path = candidate / CONFIG_FILE
        if path.is_file():
            break
    else:
        return
    from megatron_dmoe.config import load_config, resolve

    try:
        dense = resolve(load_config(str(path)))
    except Exception:  # an older or hand-edited file: the checkpoint's shapes are checked anyway
        return
    ours = resolve(cfg)
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "normalization", "activation", "add_bias_linear", "add_qkv_bias", "position_embedding_type",
            "untie_embeddings_and_output_weights")
    differ = [f"model.{k} is {getattr(dense.model, k)!r} there, {getattr(ours.model, k)!r} here"
              for k in keys if getattr(dense.model, k) != getattr(ours.model, k)]
    if differ:
        raise UpcycleError(f"{KEY}: the dense run ({path}) has another model shape: {'; '.join(differ)}. "
                           f"Keep the dense run's model.* settings in the MoE run")


def expert_output_scale(layer: MoELayer, granularity: int) -> float:
    opts = layer.options
    sums_to_one = opts.renormalize or (opts.score_function == "softmax" and not opts.pre_softmax)
    activation_scale = granularity if sums_to_one else opts.num_experts * granularity / opts.top_k
    return activation_scale / opts.topk_scaling_factor


@torch.no_grad()
def upcycle_layer(layer: MoELayer, dense_mlp, granularity: int, where: str) -> None:
    """Fill `layer`'s experts (this rank's share) from megatron's dense MLP `dense_mlp`."""
    for name in ("linear_fc1", "linear_fc2"):
        bias = getattr(getattr(dense_mlp, name), "bias", None)
        if bias is not None and bias.numel() and bool(bias.abs().max() > 0):
            raise UpcycleError(
                f"{KEY}: the dense MLP of {where} has a non-zero bias ({name}.bias), which the experts "
                f"cannot hold (they have none); train the dense run with model.add_bias_linear: false"
            )
    opts = layer.options
    fc1 = dense_mlp.linear_fc1.weight.detach()
    w2_full = dense_mlp.linear_fc2.weight.detach().t()  # [ffn, h]: y = a @ w2, as the experts
    ffn = w2_full.shape[0]
    if fc1.shape[0] != ffn * (2 if opts.activation == "swiglu" else 1):
        raise UpcycleError(f"{KEY}: the dense MLP of {where} has fc1 of shape {tuple(fc1.shape)}, which does not "
                           f"match model.activation {opts.activation} with ffn width {ffn}")
    # megatron's gated fc1 is [gate; up]: silu(x gate^T) * (x up^T)
    w1_full, v1_full = (fc1[:ffn], fc1[ffn:]) if opts.activation == "swiglu" else (fc1, None)
    width = ffn // granularity
    if width != opts.ffn_hidden_size:
        raise UpcycleError(f"{KEY}: the dense MLP of {where} is {ffn} wide; with moe.upcycle_granularity "
                           f"{granularity} the experts must be {width} wide, not {opts.ffn_hidden_size}")
    scale = expert_output_scale(layer, granularity)
    experts = layer.experts
    for target, full, factor in ((experts.w1, w1_full, 1.0), (experts.v1, v1_full, 1.0),
                                 (experts.w2, w2_full, scale)):
        if target is None:
            continue
        pieces = full.reshape(granularity, width, full.shape[-1])
        global_tensor = torch.stack([pieces[e % granularity] for e in range(opts.num_experts)]) * factor
        target.copy_(experts.layout.local_slice(global_tensor.to(target.device, target.dtype)))
    if layer.shared_experts is not None:
        layer.shared_experts.w2.zero_()


@torch.no_grad()
def upcycle_dense_checkpoint(cfg: RunConfig, model_chunks: List[torch.nn.Module], optimizer=None,
                             source: Optional[str] = None) -> Path:
    """Initialise the MoE model `model_chunks` from the dense checkpoint cfg.checkpoint.upcycle_from
    (or `source`); returns the checkpoint directory read. The optimizer's copies of the
    parameters (its fp32 main parameters) are refreshed when one is given."""
    from megatron_dmoe.model.gpt import build_gpt_model

    source = Path(source or cfg.checkpoint.upcycle_from)
    path = dense_checkpoint_path(source)
    _check_dense_run_config(source, cfg)
    granularity = cfg.moe.upcycle_granularity
    for chunk in model_chunks:
        model = _unwrap(chunk)
        on_cuda = next(model.parameters()).is_cuda
        dense = build_gpt_model(_dense_config(cfg), vocab_size=model.vocab_size, on_cuda=on_cuda,
                                vp_stage=getattr(model, "vp_stage", None))
        try:
            load_checkpoint(path, [dense])
        except CheckpointError:
            raise
        except Exception as err:  # shapes that do not match this config, missing tensors, ...
            raise UpcycleError(f"{KEY}: cannot load {path} as the dense model of this config ({err}); the MoE "
                               f"run must keep the dense run's model.* settings") from err
        dense_state = dense.state_dict()
        moe_layers = {}
        for i, layer in enumerate(model.decoder.layers):
            if isinstance(layer.mlp, MoELayer):
                moe_layers[i] = layer.mlp
                upcycle_layer(layer.mlp, dense.decoder.layers[i].mlp, granularity,
                              f"layer {layer.layer_number}")
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
                continue
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"] and int(parts[2]) in moe_layers and parts[3] == "mlp":
                continue  # experts above; router, shared experts and their state as initialised
            if name not in dense_state or dense_state[name].shape != tensor.shape:
                raise UpcycleError(f"{KEY}: {path} has no tensor {name} of shape {tuple(tensor.shape)}; the MoE "
                                   f"run must keep the dense run's model.* settings")
            tensor.copy_(dense_state[name])
        del dense
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    return path
