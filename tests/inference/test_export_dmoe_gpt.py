"""dmoe-export of models no stock transformers architecture computes (the quick-start and zoo GPT
MoEs): DmoeGptForCausalLM with its modeling file, loaded with trust_remote_code, gives our logits
and greedy tokens."""
import contextlib
import io
import json
import os
import sys

import pytest
import torch
import transformers

from megatron_dmoe.config.environment import megatron_core_release
from megatron_dmoe.export.cli import export_main
from megatron_dmoe.inference.generate import generate
from megatron_dmoe.inference.run_model import load_run
from megatron_dmoe.parallel.distributed import destroy_distributed

# importlib import mode: this folder's helper modules are imported by name
if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))

from hf_models import our_logits, tiny_tokenizer  # noqa: E402
from inference_runs import make_untrained_run  # noqa: E402

# configs/tiny.yaml's model (LayerNorm, GELU experts, learned positions, biases, top-2 of 8 after a
# softmax over all, tied embeddings), unchanged; the variants change what the modeling file reads
VARIANTS = {
    "tiny": [],
    # RoPE, SwiGLU, grouped queries, per-head query/key LayerNorm, untied output, a dense first layer,
    # a gated shared expert, sigmoid scores with the expert bias, group-limited top-4, renormalised
    # and scaled weights
    "deepseek_like": ["model.num_layers=3", "model.position_embedding_type=rope", "model.rotary_base=500",
                      "model.activation=swiglu", "model.num_query_groups=2", "model.qk_layernorm=true",
                      "model.untie_embeddings_and_output_weights=true", "moe.first_dense_layers=1",
                      "moe.shared_expert_ffn_hidden_size=64", "moe.shared_expert_gate=true",
                      "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
                      "moe.top_k=4", "moe.router_num_groups=4", "moe.router_group_topk=2",
                      "moe.router_renormalize=true", "moe.router_topk_scaling_factor=2.5"],
    # a softmax over the two chosen logits (router_pre_softmax false), an MoE every second layer,
    # RMSNorm, biases on the queries, keys and values only
    "every_second_layer": ["model.num_layers=4", "moe.layer_freq=2", "moe.router_pre_softmax=false",
                           "model.normalization=RMSNorm", "model.add_bias_linear=false", "model.add_qkv_bias=true"],
}
if megatron_core_release() < (0, 19):  # the query/key norm over the whole projection: 0.16 builds it
    VARIANTS["projection_qk_norm"] = ["model.normalization=RMSNorm", "model.qk_layernorm=true",
                                      "model.qk_layernorm_scope=projection", "model.position_embedding_type=rope"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer(folder)
    return folder


FAST = ("tiny", "deepseek_like")  # the others in the slow lane


@pytest.fixture(scope="module", params=[v if v in FAST else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS])
def export_dirs(request, tokenizer_dir, tmp_path_factory):
    """(run directory, export directory) of an untrained run of `tiny` with the variant's settings."""
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = ["data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={tokenizer_dir}",
                 "data.data_path=[never_read]", "training.device=cpu",
                 "model.init_method_std=0.1"]  # logits far enough apart that greedy choices are not near ties
    make_untrained_run(root / "run", tokenizer + VARIANTS[request.param], perturb=True)
    printed = io.StringIO()  # a module's fixture has no capsys
    with contextlib.redirect_stdout(printed):
        assert export_main([str(root / "run"), str(root / "hf")]) == 0
    return root / "run", root / "hf", printed.getvalue()


def test_export_ships_the_modeling_file_and_says_why(export_dirs):
    run_dir, hf_dir, printed = export_dirs
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["DmoeGptForCausalLM"]
    assert (hf_dir / "modeling_dmoe_gpt.py").is_file()
    assert "no stock transformers architecture computes this model (as " in printed
    assert "trust_remote_code=True" in printed


def test_transformers_computes_our_logits_and_greedy_tokens(export_dirs):
    run_dir, hf_dir, _ = export_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    assert type(hf).__name__ == "DmoeGptForCausalLM"
    run = load_run(run_dir, device="cpu")
    try:
        tokens = torch.randint(0, run.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
        ours = our_logits(run, tokens)
        with torch.no_grad():
            theirs = hf(tokens).logits.float()
        assert ours.shape == theirs.shape
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

        prompt = tokens[0, :12].tolist()
        ours_gen = generate(run.model, prompt, max_new_tokens=16, context_length=128, eod=-1,
                            vocab_size=run.vocab_size)
    finally:
        destroy_distributed()
    # through transformers' generation and its key-value cache
    theirs_gen = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert ours_gen.tokens == theirs_gen


@pytest.mark.slow
def test_the_quick_start_run_exports(cli_run, corpus_cache, tmp_path):
    """A few steps of configs/tiny.yaml on the built-in corpus, then the export: its sentencepiece
    tokenizer and its model in transformers give our token ids and logits."""
    run_dir = tmp_path / "run"
    result = cli_run(run_dir, "tiny", "training.train_iters=3", "training.eval_interval=0", "training.device=cpu",
                     "logging.progress_bar=off", "logging.tensorboard=false", "logging.plot=false",
                     f"data.cache_dir={corpus_cache}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert export_main([str(run_dir), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    run = load_run(run_dir, device="cpu")
    try:
        text = "def main(argv):\n    return os.path.join(argv[0], 'x')\n"
        assert tokenizer.encode(text) == run.tokenizer.tokenize(text)
        tokens = torch.randint(0, run.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        ours = our_logits(run, tokens)
    finally:
        destroy_distributed()
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
