"""dmoe-import: a transformers model directory (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, dense Llama and
Qwen3) as a run directory
(cli.py; checks in plan.py, config.json's fields in hf_config.py, the run written by write_run.py)."""
