"""dmoe-import: a transformers MoE model directory (Mixtral, Qwen3-MoE, OLMoE) as a run directory
(cli.py; checks in plan.py, config.json's fields in hf_config.py, the run written by write_run.py)."""
