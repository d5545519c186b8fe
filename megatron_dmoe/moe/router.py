"""Top-k router: scores every expert for every token and picks the k experts each token goes to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .global_aux_loss import GlobalLoadBalance
from .options import MoEOptions, fused_router_unsupported


@dataclass
class Routing:
    indices: torch.Tensor  # [T, k] int64: the experts each token goes to
    weights: torch.Tensor  # [T, k] the weights their outputs are combined with
    logits: torch.Tensor  # [T, E] router logits (fp32, or fp64 for fp64 inputs)
    scores: torch.Tensor  # [T, E] softmax probabilities or sigmoid scores over all experts
    tokens_per_expert: torch.Tensor  # [E] int64: assignments of non-padding tokens per expert
    # [E] fp32 sum of the probabilities over the non-padding tokens, from the fused router's own
    # launch (the load-balancing loss reads it instead of summing scores); None on the torch path
    prob_colsum: Optional[torch.Tensor] = None


def group_limited_topk(selection: torch.Tensor, top_k: int, num_groups: int, group_topk: int,
                       group_score: str = "sum"):
    """torch.topk of `selection` [T, E] restricted, per row, to its best `group_topk` of
    `num_groups` equal groups of consecutive experts (DeepSeek-V2/V3 device/node-limited routing).

    A group's score is the sum of its top (top_k // group_topk) entries with group_score "sum", as
    in megatron-core's `group_limited_topk` (DeepSeek-V3: top-2 of 8 experts in 4 of 8 groups), or
    its best entry with "max" (DeepSeek-V2)."""
    num_tokens, num_experts = selection.shape
    grouped = selection.view(num_tokens, num_groups, num_experts // num_groups)
    if group_score == "max":
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(top_k // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = torch.topk(group_scores, group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return torch.topk(selection.masked_fill(~keep, float("-inf")), top_k, dim=-1)


def _topk(selection: torch.Tensor, top_k: int, groups: Optional[Tuple[int, int, str]]):
    if groups is None:
        return torch.topk(selection, top_k, dim=-1)
    return group_limited_topk(selection, top_k, *groups)


def route(
    logits: torch.Tensor,
    top_k: int,
    score_function: str = "softmax",
    pre_softmax: bool = True,
    renormalize: bool = False,
    topk_scaling_factor: float = 1.0,
    expert_bias: Optional[torch.Tensor] = None,
    groups: Optional[Tuple[int, int, str]] = None,
):
    """Pick top-k experts per row of `logits` [T, E]; returns (indices, weights, scores).

    groups = (num_groups, group_topk, group_score): each token's k experts come from its best
    group_topk groups only (see `group_limited_topk`); the choice among them and the weights are
    as below.

    softmax + pre_softmax: top-k of softmax(logits); weights are those probabilities.
    softmax, not pre_softmax: top-k of the logits; weights are the softmax over the k chosen logits.
    sigmoid: top-k of sigmoid(logits) (+ expert_bias, which changes the choice, never the weights).
    renormalize scales each token's weights to sum 1; all weights are then multiplied by
    topk_scaling_factor.
    """
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
        if pre_softmax:
            weights, indices = _topk(scores, top_k, groups)
        else:
            top_logits, indices = _topk(logits, top_k, groups)
            weights = torch.softmax(top_logits, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        selection = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        indices = _topk(selection, top_k, groups).indices
        weights = scores.gather(-1, indices)
    else:
        raise ValueError(f"score_function={score_function!r} is not supported; use 'softmax' or 'sigmoid'.")
    if renormalize:
        # the epsilon only guards sigmoid scores that underflow to 0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if topk_scaling_factor != 1.0:
        weights = weights * topk_scaling_factor
    return indices, weights, scores


def count_assignments(indices: torch.Tensor, num_experts: int, valid: Optional[torch.Tensor] = None):
    """[E] int64 number of (token, expert) assignments per expert, counting only `valid` tokens.

    Built with scatter_add so that no value has to come back to the host.
    """
    ones = torch.ones_like(indices) if valid is None else valid.to(indices.dtype)[:, None].expand_as(indices)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=indices.device)
    return counts.scatter_add_(0, indices.reshape(-1), ones.reshape(-1))


class _HalfInputLogits(torch.autograd.Function):
    """fp32 logits of bf16/fp16 x and weight from one tensor-core GEMM with fp32 output: the same
    values as an fp32 GEMM of the upcast operands (products of half values are exact in fp32),
    without the fp32 copy of x that the upcast would write and keep for backward. Backward runs
    in the inputs' precision with fp32 accumulation, as megatron's default router does."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_half = grad.to(x.dtype)
        dx = torch.mm(grad_half, weight) if ctx.needs_input_grad[0] else None
        dw = torch.mm(grad_half.t(), x, out_dtype=torch.float32).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, E] logits in fp32 (fp64 for fp64 inputs) of x [T, h] and the router weight [E, h]."""
    half = (torch.float16, torch.bfloat16)
    if x.is_cuda and x.dtype in half and weight.dtype == x.dtype:
        return _HalfInputLogits.apply(x, weight)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    return F.linear(x.to(compute_dtype), weight.to(compute_dtype))


class _RandomLogits(torch.autograd.Function):
    """Standard-normal logits in place of the router's, gradient passed straight through
    (megatron-core's RandomSTE): every expert gets about the same share of tokens."""

    @staticmethod
    def forward(ctx, logits):
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


class TopKRouter(torch.nn.Module):
    """Router weight [E, h] (logits computed in fp32) and, optionally, the expert-bias state.

    `fused`, from options.router_impl: route with dmoe_kernels' fused softmax top-k kernels (one
    kernel forward and one backward, the load-balancing loss's column sums included) instead of
    torch's softmax, topk and sum. None (auto): fused for fp32 logits on CUDA when the options allow
    it (options.fused_router_unsupported); False: always torch; True: always fused (an error for
    logits that are not fp32; CPU tensors need Triton's interpreter). An attribute, so a built
    layer's router can be switched (`layer.router.fused = False`)."""

    def __init__(self, options: MoEOptions, dtype=torch.float32, device=None):
        super().__init__()
        self.fused = {"auto": None, "fused": True, "torch": False}[options.router_impl]
        # the options never change: whether they allow the kernels is decided once, not per call
        self._unfusable = fused_router_unsupported(vars(options))
        self.options = options
        E, h = options.num_experts, options.hidden_size
        self.weight = torch.nn.Parameter(torch.empty(E, h, dtype=dtype, device=device))
        with torch.no_grad():
            self.weight.normal_(0.0, options.init_method_std)
        # running sums over the training step for the global aux loss; None for the other types
        self.global_load = GlobalLoadBalance(E, device=device) if options.aux_loss_type == "global" else None
        self.groups = None
        if options.router_num_groups is not None:
            self.groups = (options.router_num_groups, options.router_group_topk, options.router_group_score)
        if options.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device))
            # assignments seen in training forwards since the last bias update; not checkpointed
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(E, dtype=torch.int64, device=device), persistent=False
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None

    def _apply(self, fn, *args, **kwargs):
        # Mixed-precision wrappers cast every floating buffer; the bias moves by small steps
        # (bias_update_rate) that bf16 would round away, so it stays fp32 whatever the module's dtype.
        kept = self.expert_bias
        result = super()._apply(fn, *args, **kwargs)
        if kept is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = kept.to(device=self.expert_bias.device, dtype=torch.float32)
        return result

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None, count: bool = True) -> Routing:
        """x [T, h]; valid [T] bool (False marks padding tokens, left out of the counts).

        count=False leaves Routing.tokens_per_expert None for a caller that counts the assignments
        anyway (the block-padded dispatch does) and then passes them to `record_load`."""
        opts = self.options
        if self.training and opts.input_jitter_eps:
            # in fp32: bf16 resolves steps of only 2**-7 around 1
            eps = opts.input_jitter_eps
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        # the weights, scores and logits leave in the precision the layer expects (fp32, or fp64 inputs')
        out_dtype = torch.promote_types(x.dtype, torch.float32)
        if opts.router_dtype == "fp64":
            x = x.to(torch.float64)
        logits = router_logits(x, self.weight)
        if opts.force_load_balancing:
            logits = _RandomLogits.apply(logits)
        colsum = None
        if self.uses_fused(logits):
            from dmoe_kernels.router.functional import fused_route  # imports triton

            indices, weights, scores, colsum = fused_route(
                logits, opts.top_k, opts.renormalize, opts.topk_scaling_factor, valid
            )
        else:
            indices, weights, scores = route(
                logits,
                opts.top_k,
                score_function=opts.score_function,
                pre_softmax=opts.pre_softmax,
                renormalize=opts.renormalize,
                topk_scaling_factor=opts.topk_scaling_factor,
                expert_bias=self.expert_bias,
                groups=self.groups,
            )
        if logits.dtype != out_dtype:
            weights, scores, logits = weights.to(out_dtype), scores.to(out_dtype), logits.to(out_dtype)
        counts = None
        if count:
            counts = count_assignments(indices, opts.num_experts, valid)
            self.record_load(counts)
        return Routing(indices, weights, logits, scores, counts, colsum)

    def uses_fused(self, logits: torch.Tensor) -> bool:
        """Do these logits [T, E] go through the fused router kernels (see the class docstring)?"""
        if self.fused is False:
            return False
        if self.fused is None:
            return logits.is_cuda and logits.dtype == torch.float32 and self._unfusable is None
        if self._unfusable is not None:  # switched on by hand for options the kernels cannot route
            raise ValueError(f"TopKRouter.fused=True: the fused router cannot route with {self._unfusable}; "
                             "set fused to None or False")
        if logits.dtype != torch.float32:
            raise ValueError(
                f"TopKRouter.fused=True: the logits are {logits.dtype} (from {logits.dtype} inputs); the fused "
                "router takes fp32 logits: use router_impl auto or torch for this precision"
            )
        return True

    def reset_global_aux_loss_tracker(self) -> None:
        """megatron-core's name: its finalize_model_grads calls it on every module after each step
        (with moe_router_load_balancing_type global_aux_loss), so Megatron-LM's loop resets ours too."""
        if self.global_load is not None:
            self.global_load.reset()

    def record_load(self, counts: torch.Tensor) -> None:
        """Count a training forward's assignments for the expert-bias update."""
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            # grad-enabled only: a forward repeated for activation recompute must not count twice
            self.local_tokens_per_expert += counts

    @torch.no_grad()
    def apply_bias_update(self, load: torch.Tensor) -> None:
        """bias += rate * sign(mean load - load): underused experts become likelier picks."""
        load = load.to(torch.float32)
        self.expert_bias += self.options.bias_update_rate * torch.sign(load.mean() - load)
        self.local_tokens_per_expert.zero_()
