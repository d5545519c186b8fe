"""dmoe-import of dense Llama and Qwen3 and of Qwen2-MoE (a gated shared expert, query/key/value
biases): tiny random models built with transformers become runs that compute their logits and
export back to the same weights; a dense import upcycles into a dMoE that trains."""
import contextlib
import io
import json
import os
import sys

import pytest
import safetensors.torch
import torch
import transformers

from megatron_dmoe.export.cli import export_main
from megatron_dmoe.hf_import.cli import import_main
from megatron_dmoe.inference.run_model import load_run
from megatron_dmoe.parallel.distributed import destroy_distributed

# importlib import mode: this folder's helper module is imported by name
if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))

from hf_models import TEXTS, logits, our_logits, save_tiny_model  # noqa: E402

FAMILIES = {
    # heads wider than hidden / heads, untied embeddings
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(intermediate_size=96, head_dim=24)),
    # per-head query/key norm, tied embeddings, a large RoPE theta
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(intermediate_size=96, tie_word_embeddings=True, rope_theta=1000000.0)),
    # a shared expert behind a sigmoid gate, biases on the queries, keys and values, no renormalisation
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       num_experts=4, num_experts_per_tok=2, qkv_bias=True, norm_topk_prob=False)),
}


def _import(hf_dir, run_dir, *overrides):
    with contextlib.redirect_stdout(io.StringIO()):
        return import_main([str(hf_dir), "--run-dir", str(run_dir), "training.device=cpu", *overrides])


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, transformers model, its directory, the run directory imported without data)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(*FAMILIES[request.param], root / "hf")
    assert _import(root / "hf", root / "run") == 0
    return request.param, hf, root / "hf", root / "run"


@pytest.fixture
def tokens():
    return torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))


def test_imported_run_computes_the_models_logits(imported, tokens):
    _, hf, _, run_dir = imported
    run = load_run(run_dir, device="cpu")
    try:
        ours = our_logits(run, tokens)
    finally:
        destroy_distributed()
    torch.testing.assert_close(ours, logits(hf, tokens), rtol=0, atol=1e-5)


def test_export_gives_back_the_same_weights_and_architecture(imported, tokens, tmp_path):
    family, hf, hf_dir, run_dir = imported
    with contextlib.redirect_stdout(io.StringIO()):
        assert export_main([str(run_dir), str(tmp_path / "out")]) == 0
    before = safetensors.torch.load_file(hf_dir / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    assert torch.equal(logits(back, tokens), logits(hf, tokens))


@pytest.mark.parametrize("family, changes, named", [
    ("llama", dict(attention_bias=True), "attention_bias=true is not supported"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    ("qwen2_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported"),
])
def test_an_unsupported_config_is_refused_in_one_line_before_any_work(family, changes, named, tmp_path, capsys):
    config_class, _, extra = FAMILIES[family]
    config = config_class(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **extra)
    config.architectures = [FAMILIES[family][1].__name__]
    config.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    assert import_main([str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "run").exists()


def _data(tmp_path, tokenizer_dir):
    """TEXTS tokenized with the tokenizer `tokenizer_dir` (an indexed dataset prefix)."""
    from megatron_dmoe.data import preprocess_data

    (tmp_path / "text").mkdir()
    for i in range(40):
        (tmp_path / "text" / f"f{i}.py").write_text(TEXTS[i % len(TEXTS)] * (1 + i % 3) + f"# {i}\n")
    preprocess_data([str(tmp_path / "text")], str(tmp_path / "code"), str(tokenizer_dir),
                    tokenizer_type="HuggingFaceTokenizer", input_format="text", glob="*.py", progress=False)
    return str(tmp_path / "code_text_document")


@pytest.fixture
def llama(tmp_path):
    """(transformers Llama, its run imported without data, data tokenized with its tokenizer)."""
    hf = save_tiny_model(*FAMILIES["llama"], tmp_path / "hf")
    assert _import(tmp_path / "hf", tmp_path / "dense") == 0
    return hf, tmp_path / "dense", _data(tmp_path, tmp_path / "dense" / "tokenizer")


@pytest.mark.slow
def test_an_imported_qwen2_moe_trains(cli_run, tmp_path):
    save_tiny_model(*FAMILIES["qwen2_moe"], tmp_path / "hf")
    data = _data(tmp_path, tmp_path / "hf")
    assert _import(tmp_path / "hf", tmp_path / "run", f"data.data_path={data}", "training.lr=3e-3",
                   "training.lr_warmup_iters=0", "training.lr_decay_style=constant", "training.train_iters=6",
                   "training.micro_batch_size=2", "training.global_batch_size=2", "training.eval_interval=0",
                   "logging.progress_bar=off", "logging.tensorboard=false", "logging.plot=false",
                   "logging.log_interval=1") == 0
    result = cli_run(tmp_path / "run", "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def _upcycle(cli_run, dense, data, run_dir, *overrides):
    """dmoe-train from the dense run's config.yaml, four experts upcycled from its MLPs."""
    result = cli_run(run_dir, str(dense / "config.yaml"), f"checkpoint.upcycle_from={dense}", "moe.num_experts=4",
                     "moe.top_k=2", "moe.router_renormalize=true", f"data.data_path={data}",
                     "training.micro_batch_size=2", "training.global_batch_size=2", "training.eval_interval=0",
                     "logging.progress_bar=off", "logging.tensorboard=false", "logging.plot=false",
                     "logging.log_interval=1", *overrides)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_dense_import_upcycles_into_a_dmoe_that_computes_it_and_trains(llama, cli_run, tmp_path, tokens):
    hf, dense, data = llama
    # a step too small to change a weight: the upcycled dMoE (every expert the dense MLP, weights
    # summing to 1) computes what transformers' Llama does
    _upcycle(cli_run, dense, data, tmp_path / "same", "training.train_iters=1", "training.lr=1e-30",
             "training.min_lr=1e-30")
    run = load_run(tmp_path / "same", device="cpu")
    try:
        assert run.cfg.moe.num_experts == 4
        ours = our_logits(run, tokens)
    finally:
        destroy_distributed()
    torch.testing.assert_close(ours, logits(hf, tokens), rtol=0, atol=1e-5)
    losses = _upcycle(cli_run, dense, data, tmp_path / "trained", "training.train_iters=6", "training.lr=3e-3",
                      "training.lr_warmup_iters=0", "training.lr_decay_style=constant")
    assert len(losses) == 6 and losses[-1] < losses[0], losses
