"""training.fp8: block-scaled fp8 products need fp8 tensor cores (compute capability 9.0, Hopper,
or newer) and run the rest of the model in bf16. Refused here, before anything is built, where they
cannot run; one problem for the key, the first that applies."""
from __future__ import annotations

from .state import CheckState

KEY = "training.fp8"
HOPPER = (9, 0)


def check(state: CheckState) -> None:
    v, ok = state.v, state.ok
    if not ok(KEY) or v(KEY) is None:
        return
    value = v(KEY)
    device = v("training.device") if ok("training.device") else "auto"
    if device == "cpu" or (device == "auto" and not state.env.cuda):
        state.problem(KEY, f"{value} needs a GPU with fp8 tensor cores (Hopper, compute capability 9.0, "
                      f"or newer) and this run is on CPU; set training.fp8: null (CPU runs train in fp32)")
        return
    capability = state.env.gpu_capability()
    if capability is not None and tuple(capability) < HOPPER:
        state.problem(KEY, f"{value} needs fp8 tensor cores (compute capability 9.0, Hopper, or newer); "
                      f"this GPU has {capability[0]}.{capability[1]}; set training.fp8: null and "
                      f"training.bf16: true")
        return
    if ok("training.bf16") and not v("training.bf16"):
        state.problem(KEY, f"{value} runs the operations outside its products in bf16; set "
                      f"training.bf16: true")
        return
    _check_layout(state, value)


def _check_layout(state: CheckState, value: str) -> None:
    """The fp8 linears are unsharded plain matmuls in megatron-core's local modules (model/linear.py);
    the experts' fp8 products need TMA-sized rows and K steps of at least 32 (moe/experts/products.py)."""
    v, ok = state.v, state.ok
    fix = "set training.fp8: null"
    if ok("parallel.tensor_model_parallel_size") and v("parallel.tensor_model_parallel_size") > 1:
        state.problem(KEY, f"{value} runs unsharded linears only; parallel.tensor_model_parallel_size is "
                      f"{v('parallel.tensor_model_parallel_size')}; use 1 (with data or expert parallelism) "
                      f"or {fix}")
    elif ok("parallel.sequence_parallel") and v("parallel.sequence_parallel"):
        state.problem(KEY, f"{value} does not run with parallel.sequence_parallel; set it to false or {fix}")
    elif ok("model.multi_latent_attention") and v("model.multi_latent_attention"):
        state.problem(KEY, f"{value} has no fp8 path for multi-latent attention's projections; set "
                      f"model.multi_latent_attention: false or {fix}")
    elif ok("model.transformer_impl") and v("model.transformer_impl") == "transformer_engine":
        state.problem(KEY, f"{value} is this package's own fp8 (no Transformer Engine); set "
                      f"model.transformer_impl: local (or auto) or {fix}")
    elif ok("model.hidden_size") and v("model.hidden_size") % 16:
        state.problem(KEY, f"{value} needs model.hidden_size to be a multiple of 16 (fp8 rows of 16-byte "
                      f"multiples for the tensor-memory loads); it is {v('model.hidden_size')}; {fix}")
    elif ok("moe.num_experts", "moe.block_size") and v("moe.num_experts") > 0 and v("moe.block_size") < 32:
        state.problem(KEY, f"{value} needs moe.block_size 32 or more (fp8 tensor cores take K steps of 32); "
                      f"it is {v('moe.block_size')}; {fix}")
