"""Everything this project changes or works around in megatron-core, and where its releases differ.

When a new megatron-core release lands, this folder is what to re-check: each module says which
releases need it and what upstream would have to change for it to go. These modules import only
megatron-core, torch and each other.

mcore.py            which release is installed, and where its objects live (no patches)
patching.py         replace an attribute for the length of a block and put it back
cpu/                megatron-core's CUDA-minded code paths redirected to the host (CPU runs)
torch_dist_save.py  our writer class and results queue inside the torch_dist checkpoint save
distopt_state.py    the distributed optimizer's reshardable checkpoint state at its own offsets
distopt_adam_step.py the distributed optimizer's reshardable checkpoint loaded into torch's Adam (its step)
distopt_empty_step.py the Adam step of a distributed-optimizer part with no parameters here (a stage without experts)
eager_fusions.py    megatron-core's fusions left uncompiled where torch has no CUDA (a faster process start)
host_grad_norm.py   megatron-core's gradient norm on the host accumulated in float64
foreach_multi_tensor.py torch's foreach kernels for megatron-core's multi-tensor fallbacks
graph_buffers.py    0.16's CUDA-graph input buffers held until their backward is captured
schedule_capture.py the forward-backward schedules kept from capturing CUDA graphs themselves
block_final_norm.py a layer spec's block (Megatron-LM's --spec) gets our norm, not torch's, last
blended_dataset_rank.py 0.16's BlendedDataset in a process without torch.distributed
optimizer_zero_step.py an optimizer checkpoint of step 0 that loads again
mla_without_te.py   0.16's multi-latent attention built without Transformer Engine installed
mla_query_projection.py 0.19's multi-latent attention without a query latent, from local modules
aux_loss_scale.py   the aux-loss scale kept on the losses' device and written in place
"""
