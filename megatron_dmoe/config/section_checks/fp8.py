"""training.fp8: block-scaled fp8 products need fp8 tensor cores (compute capability 9.0, Hopper,
or newer) and run the rest of the model in bf16. Refused here, before anything is built, where they
cannot run; one problem for the key, the first that applies."""
from __future__ import annotations

from .state import CheckState

KEY = "training.fp8"
HOPPER = (9, 0)
# The model's layers and expert products do not run in fp8 yet (dmoe_kernels.fp8 has the
# quantization, the products and an fp8 linear): until they do, a run that asks for fp8 is refused
# rather than trained in bf16 under an fp8 label.
LAYERS_USE_FP8 = False


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
    if not LAYERS_USE_FP8:
        state.problem(KEY, f"{value} is not used by the model's layers in this version (only "
                      f"dmoe_kernels.fp8 has the kernels); set training.fp8: null and "
                      f"training.bf16: true")
