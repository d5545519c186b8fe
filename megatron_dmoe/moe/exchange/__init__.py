"""The expert-parallel exchange: how an MoE layer's rows travel to the ranks that hold their experts
and back, with autograd both ways.

  dispatcher.py  ExpertParallelDispatcher: expands assignments to virtual experts (ExpertLayout,
                 megatron_dmoe/parallel/expert_layout.py), sorts the rows by destination rank,
                 sends them (dispatch), sends the expert outputs back and sums each token's
                 weighted copies (combine); picks one of the two exchanges below
  all_to_all.py  the NCCL exchange: a variable-split all_to_all_single with autograd (any backend
                 with uneven splits: NCCL on GPUs, gloo between CPU processes) and the count
                 exchange that gives its split sizes
  symmetric.py   the symmetric-memory exchange: buffers mapped into every GPU of the group, rows
                 stored straight into the peers' buffers by Triton kernels, offsets computed on
                 the device; SymmetricExchanges, the buffers a run's layers share (owned by
                 moe/run_state.py)

Which exchange runs is `moe.ep_exchange` (MoEOptions.ep_exchange, handed to the dispatcher by
moe/paths/choose.py):
  nccl       all_to_all.py, always. Its split sizes are read on the host once per dispatch, so it
             cannot run inside a CUDA graph.
  symmetric  symmetric.py; config validation refuses it without CUDA, and the first dispatch
             raises where it cannot run (ranks on several hosts, peer mappings refused on any
             rank). Nothing is read on the host, so it
             runs inside CUDA graphs.
  auto       symmetric where the group allows it, else nccl: decided once, collectively, at the
             first dispatch (ExpertParallelDispatcher._use_symmetric).

The kernels live in the standalone library dmoe_kernels (kernels/ in the checkout):
kernels/exchange/ (ops.py, the launchers: exchange plan, count posting, row stores; kernels.py,
the Triton code) for the symmetric exchange, and kernels/permutation/ (ops.py, functional.py) for
the sort into destination order and the weighted combine on CUDA, which the local dispatchers use
too.

What stays elsewhere, and why: the dispatchers that run on one rank (dropless, padded, capacity)
and their base class TokenDispatcher stay in moe/dispatch/, since they exchange nothing; the
layer's execution path around this dispatcher (experts in arrival order, shared experts
overlapping the exchange) is moe/paths/expert_parallel.py, beside the other paths; the sparse
experts that push their outputs from their padded buffer straight back into the senders'
`to_sources` buffers (the combine's push without a pass back to arrival order) are
moe/experts/sparse_returning.py, which the path runs over the symmetric exchange; the process
groups and the expert layout are megatron_dmoe/parallel/, which imports nothing from moe/.

Nothing is imported here: `from megatron_dmoe.moe.exchange.dispatcher import ...` and the like.
"""
