"""The dropless MoE layer: router, aux losses, token dispatch, expert MLP backends, metrics."""
from .aux_loss import AuxLossScaler, load_balancing_loss, z_loss
from .capacity import CapacityDispatcher, expert_capacity
from .dispatcher import DroplessDispatcher, TokenDispatcher
from .expert_bias import update_expert_biases
from .experts import ExpertMLP
from .global_aux_loss import GlobalLoadBalance, reset_global_load_balance
from .layer import MoELayer
from .metrics import MoEMetrics, get_moe_metrics
from .options import MoEOptions
from .router import Routing, TopKRouter, route
from .shared_experts import SharedExpertMLP

__all__ = [
    "AuxLossScaler",
    "CapacityDispatcher",
    "DroplessDispatcher",
    "ExpertMLP",
    "GlobalLoadBalance",
    "MoELayer",
    "MoEMetrics",
    "MoEOptions",
    "Routing",
    "SharedExpertMLP",
    "TokenDispatcher",
    "TopKRouter",
    "expert_capacity",
    "get_moe_metrics",
    "load_balancing_loss",
    "reset_global_load_balance",
    "route",
    "update_expert_biases",
    "z_loss",
]
