"""Token dispatchers: where each routed copy of a token goes before the experts, and the weighted
combine after them. One per execution path (moe/paths/):

  base.py             TokenDispatcher (dispatch, combine) and the helpers the dispatchers share
  dropless.py         every copy kept, rows sorted by expert (grouped and reference experts)
  padded.py           the block-sparse experts' plan: copies straight into the block-padded buffer
  capacity.py         the token-dropping baseline: a capacity buffer per expert

These run on one rank. The expert-parallel dispatcher, which exchanges rows with the other ranks
of its group, lives with its two exchanges in moe/exchange/ (dispatcher.py).
"""
