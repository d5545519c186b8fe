"""dmoe-import: a tiny random Mixtral, Qwen3-MoE and OLMoE built with transformers becomes a run that
computes their logits, trains on, and exports back to the same weights."""
import json
import os
import sys

import pytest
import safetensors.torch
import torch
import transformers

from megatron_dmoe.config.environment import megatron_core_release
from megatron_dmoe.hf_import.cli import import_main
from megatron_dmoe.inference.run_model import load_run
from megatron_dmoe.parallel.distributed import destroy_distributed

# importlib import mode: this folder's helper module is imported by name
if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))

from hf_models import check_resumed_run_trains_and_exports, logits, our_logits  # noqa: E402

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.1)
# OLMoE's query/key norm over the whole projection is built with megatron-core 0.16, refused with 0.19
PROJECTION_QK_NORM = megatron_core_release() < (0, 19)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # heads wider than hidden / heads, a large RoPE theta, no renormalisation, tied embeddings
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       head_dim=24, rope_theta=1000000.0, norm_topk_prob=False, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
}
DATA = "data.data_path=data/never_read_text_document"  # refusals come first
TRAIN = ["model.seq_length=32", "training.train_iters=5", "training.micro_batch_size=4",
         "training.global_batch_size=4", "training.lr=3e-3", "training.lr_warmup_iters=0",
         "training.lr_decay_style=constant", "training.eval_interval=0", "training.device=cpu",
         "logging.log_interval=1", "logging.progress_bar=off", "logging.tensorboard=false", "logging.plot=false"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, corpus, tmp_path_factory):
    """(family, transformers model, its directory, the imported run directory)."""
    from megatron_dmoe.export.tokenizer_files import write_tokenizer_files

    prefix, tokenizer = corpus
    config_class, model_class, extra = FAMILIES[request.param]
    config = config_class(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eod, bos_token_id=tokenizer.eod,
                          pad_token_id=None, **COMMON, **extra)
    torch.manual_seed(0)
    hf = model_class(config).eval()
    with torch.no_grad():  # norms away from their initial ones
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf")
    write_tokenizer_files(tokenizer, root / "hf", 128)
    status = import_main([str(root / "hf"), "--run-dir", str(root / "run"), f"data.data_path={prefix}", *TRAIN])
    if request.param == "olmoe" and not PROJECTION_QK_NORM:
        assert status == 2 and not (root / "run").exists()  # refused in one line before any work
        pytest.skip(f"megatron-core {megatron_core_release()} builds per-head query/key norms only")
    assert status == 0
    return request.param, hf, root / "hf", root / "run"


@pytest.fixture
def tokens(corpus):
    return torch.randint(0, corpus[1].vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def test_imported_run_computes_the_models_logits(imported, tokens):
    _, hf, _, run_dir = imported
    run = load_run(run_dir, device="cpu")
    try:
        ours = our_logits(run, tokens)
    finally:
        destroy_distributed()
    theirs = logits(hf, tokens)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_export_gives_back_the_same_weights_and_logits(imported, tokens, tmp_path):
    from megatron_dmoe.export.cli import export_main

    family, hf, hf_dir, run_dir = imported
    assert export_main([str(run_dir), str(tmp_path / "out")]) == 0
    before = safetensors.torch.load_file(hf_dir / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == json.loads((hf_dir / "config.json").read_text())["architectures"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    assert torch.equal(logits(back, tokens), logits(hf, tokens))


def test_resumed_run_trains_and_exports(imported, tokens, cli_run, tmp_path):
    # fine-tuned here, the model goes back out and computes what ours does
    check_resumed_run_trains_and_exports(imported[3], tmp_path, cli_run, tokens)


@pytest.fixture
def qwen3_dir(tmp_path):
    """A Qwen3-MoE directory with neither weights nor a real tokenizer: every refusal below comes
    before they are read (these tests need no corpus: the fast lane runs them)."""
    config_class, _, extra = FAMILIES["qwen3_moe"]
    config_class(vocab_size=256, architectures=["Qwen3MoeForCausalLM"], **COMMON, **extra).save_pretrained(
        tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    return tmp_path / "hf"


def _refusal(args, capsys):
    assert import_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("changes, named", [
    (dict(architectures=["PhiForCausalLM"]), "architectures=['PhiForCausalLM'] is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
    (dict(clip_qkv=8.0), "clip_qkv=8.0 is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_parameters.rope_type='yarn'"),
    (dict(hidden_act="gelu"), 'hidden_act="gelu" is not supported'),
    (dict(mlp_only_layers=[0]), "mlp_only_layers=[0] is not supported"),
])
def test_an_unsupported_config_is_refused_in_one_line_before_any_work(changes, named, qwen3_dir, tmp_path, capsys):
    config = json.loads((qwen3_dir / "config.json").read_text())
    (qwen3_dir / "config.json").write_text(json.dumps({**config, **changes}))
    err = _refusal([str(qwen3_dir), "--run-dir", str(tmp_path / "run"), DATA], capsys)
    assert named in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, named", [
    (["model.hidden_size=128"], "model.hidden_size is read from"),
    (["data.tokenizer_model=other"], "data.tokenizer_model: the run uses"),
])
def test_overrides_of_the_models_settings_are_refused(overrides, named, qwen3_dir, tmp_path, capsys):
    err = _refusal([str(qwen3_dir), "--run-dir", str(tmp_path / "run"), DATA, *overrides], capsys)
    assert named in err
    assert not (tmp_path / "run").exists()


def test_missing_weights_are_refused_before_any_work(qwen3_dir, tmp_path, capsys):
    err = _refusal([str(qwen3_dir), "--run-dir", str(tmp_path / "run"), DATA], capsys)
    assert "has no *.safetensors files" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("width, expected", [(1408, {"moe.block_size": 128}), (96, {"moe.block_size": 32}),
                                             (16, {"moe.block_size": 16}), (24, {"moe.backend": "grouped"})])
def test_the_sparse_block_divides_the_imported_experts_width(width, expected, tmp_path):
    """The block size comes from the imported experts' width (DeepSeek-V2-Lite's 1408: 128), not
    from the base config; where no block size divides it, the grouped backend."""
    from megatron_dmoe.export.hf_families import MIXTRAL
    from megatron_dmoe.hf_import.hf_config import model_keys

    config = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=width, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                  rope_theta=10000.0, max_position_embeddings=128)
    _, defaults = model_keys(config, MIXTRAL, tmp_path / "config.json")
    chosen = dict(text.split("=", 1) for text in defaults if text.startswith(("moe.block_size", "moe.backend")))
    assert chosen == {key: json.dumps(value) for key, value in expected.items()}
