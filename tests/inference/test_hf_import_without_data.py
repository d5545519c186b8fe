"""dmoe-import without data.data_path: the run generates what transformers generates, evaluates on
data given then, exports, and asks for data in one line when it is trained."""
import contextlib
import io
import json
import os
import shutil
import sys

import pytest
import torch
import transformers

from megatron_dmoe.hf_import.cli import import_main
from megatron_dmoe.hf_import.fine_tuning import LR, MIN_LR, WARMUP_ITERS

# importlib import mode: this folder's helper module is imported by name
if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))

from hf_models import TEXTS, logits, save_tiny_model  # noqa: E402

MIXTRAL = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
PROMPT = "def main(argv):\n"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its directory, the run directory, what dmoe-import printed)."""
    root = tmp_path_factory.mktemp("no_data")
    hf = save_tiny_model(transformers.MixtralConfig, transformers.MixtralForCausalLM, MIXTRAL, root / "hf")
    out = io.StringIO()  # a module's fixture has no capsys
    with contextlib.redirect_stdout(out):
        status = import_main([str(root / "hf"), "--run-dir", str(root / "run"), "training.device=cpu"])
    assert status == 0
    return hf, root / "hf", root / "run", out.getvalue()


def test_import_prints_the_fine_tuning_defaults_it_chose(imported):
    printed, run_dir = imported[3], imported[2]
    assert (f"fine-tuning defaults: training.lr={LR} training.min_lr={MIN_LR} "
            f"training.lr_warmup_iters={WARMUP_ITERS} model.seq_length=128") in printed
    assert f"dmoe-train --run-dir {run_dir} --resume data.data_path=PREFIX" in printed
    from megatron_dmoe.inference.run_model import read_run_config

    cfg = read_run_config(run_dir)
    assert (cfg.training.lr, cfg.training.min_lr, cfg.training.lr_warmup_iters) == (LR, MIN_LR, WARMUP_ITERS)
    assert cfg.data.data_path == []


def test_generate_gives_transformers_greedy_tokens(imported, capsys):
    from megatron_dmoe.inference.generate_cli import generate_main

    hf, hf_dir, run_dir, _ = imported
    capsys.readouterr()
    assert generate_main([str(run_dir), "--prompt", PROMPT, "--device", "cpu", "--max-tokens", "24", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer(PROMPT).input_ids
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    if ours["stop_reason"] == "eod":
        theirs = theirs[:theirs.index(tokenizer.eos_token_id)]
    assert ours["tokens"] == theirs
    assert len(set(ours["tokens"])) > 2  # a continuation that depends on what came before


def _one_error_line(capsys, prog, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error: ")
    for word in words:
        assert word in err[0], err[0]


def test_training_and_evaluating_without_data_ask_for_data_in_one_line(imported, capsys):
    from megatron_dmoe.cli import train_main
    from megatron_dmoe.inference.eval_cli import eval_main

    run_dir = imported[2]
    capsys.readouterr()
    assert train_main(["--run-dir", str(run_dir), "--resume"]) == 2
    _one_error_line(capsys, "dmoe-train", "data.data_path is empty", "data.data_path=PREFIX",
                    f"--tokenizer-model {(run_dir / 'tokenizer').absolute()}")
    assert eval_main([str(run_dir), "--device", "cpu"]) == 2
    _one_error_line(capsys, "dmoe-eval", "has no data of its own", "--data-path PREFIX")


@pytest.fixture(scope="module")
def data(imported, tmp_path_factory):
    """TEXTS tokenized with the run's tokenizer (an indexed dataset prefix)."""
    from megatron_dmoe.data import preprocess_data

    root = tmp_path_factory.mktemp("data")
    for i in range(40):
        (root / f"f{i}.py").write_text(TEXTS[i % len(TEXTS)] * (1 + i % 3) + f"# {i}\n")
    preprocess_data([str(root)], str(root / "code"), str(imported[2] / "tokenizer"),
                    tokenizer_type="HuggingFaceTokenizer", input_format="text", glob="*.py", progress=False)
    return str(root / "code_text_document")


def test_eval_on_given_data_is_transformers_loss(imported, data, capsys):
    """The loss over the given data's sequences equals transformers' mean next-token loss on them."""
    from megatron_dmoe.inference.eval_cli import eval_main
    from megatron_dmoe.inference.evaluate import _dataset_over
    from megatron_dmoe.inference.run_model import load_run
    from megatron_dmoe.parallel.distributed import destroy_distributed

    hf, _, run_dir, _ = imported
    capsys.readouterr()
    assert eval_main([str(run_dir), "--device", "cpu", "--data-path", data, "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    run = load_run(run_dir, device="cpu")
    try:
        dataset = _dataset_over(run, [data])
        micro = run.cfg.training.micro_batch_size
        samples = [dataset[i] for i in range(result["micro_batches"] * micro)]
    finally:
        destroy_distributed()
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples])
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples])
    loss = torch.nn.functional.cross_entropy(logits(hf, tokens).flatten(0, 1), labels.flatten())
    assert result["tokens"] == labels.numel()
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_export_loads_in_transformers_as_the_model_it_came_from(imported, tmp_path):
    from megatron_dmoe.export.cli import export_main

    hf, _, run_dir, _ = imported
    assert export_main([str(run_dir), str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(back, tokens), logits(hf, tokens))


@pytest.mark.slow
def test_the_run_trains_once_given_data(imported, data, cli_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(imported[2], run_dir)  # the module's run stays without data
    result = cli_run(run_dir, "--resume", f"data.data_path={data}", "training.train_iters=3",
                     "training.micro_batch_size=4", "training.eval_interval=0", "logging.progress_bar=off",
                     "logging.tensorboard=false", "logging.plot=false", "logging.log_interval=1")
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3
    from megatron_dmoe.inference.run_model import read_run_config

    assert read_run_config(run_dir).data.data_path == [data]
