"""The dropless MoE layer: router, aux losses, token dispatch, expert MLP backends, metrics."""
from .aux_loss import AuxLossScaler, load_balancing_loss, z_loss
from .dispatch.base import TokenDispatcher
from .dispatch.capacity import CapacityDispatcher, expert_capacity
from .dispatch.dropless import DroplessDispatcher
from .expert_bias import update_expert_biases
from .experts import ExpertMLP
from .global_aux_loss import GlobalLoadBalance, reset_global_load_balance
from .layer import MoELayer
from .metrics import MoEMetrics
from .options import MoEOptions
from .router import Routing, TopKRouter, route
from .run_state import MoERunState, run_state_of, use_run_state
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
    "MoERunState",
    "Routing",
    "SharedExpertMLP",
    "TokenDispatcher",
    "TopKRouter",
    "expert_capacity",
    "load_balancing_loss",
    "reset_global_load_balance",
    "route",
    "run_state_of",
    "update_expert_biases",
    "use_run_state",
    "z_loss",
]
