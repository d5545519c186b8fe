"""Every dmoe-train and dmoe-sweep example of README.md runs as written on the machine it names.

The CPU examples train here, shortened (later overrides win); the GPU examples are parsed and
their configs validated for GPUs, and zoo/dmoe_xs also starts on this CPU (fp32, with a notice).
Sweep dry runs run as written. A new example must be added to one of the lists below, so none
goes untested.
"""
import re
import shlex
from pathlib import Path

import pytest

from megatron_dmoe.config import Environment, load_config, resolve, validate
from train_helpers import small_args

README = Path(__file__).resolve().parents[2] / "README.md"

CPU_EXAMPLES = {
    "dmoe-train",
    "dmoe-train --micro-batch-size 4 --moe-router-topk 2 --bf16",  # Megatron-LM's flags; bf16 dropped on a CPU
    "dmoe-train moe.top_k=1 training.train_iters=50",
    "dmoe-train --run-dir runs/tiny",
}
# (command, number of processes): validated for a GPU machine; each also starts on this CPU
GPU_EXAMPLES = {
    "dmoe-train zoo/dmoe_xs --run-dir runs/xs": 1,
    "dmoe-train --nproc-per-node 4 zoo/dmoe_small parallel.expert_model_parallel_size=4": 4,
    "dmoe-train --nproc-per-node 2 --run-dir runs/RUN --resume parallel.expert_model_parallel_size=2": 2,
    "dmoe-train --nproc-per-node 8 zoo/dmoe_medium parallel.tensor_model_parallel_size=2 "
    "parallel.sequence_parallel=true parallel.expert_model_parallel_size=8": 8,
}
# (command, number of processes): validated for a CPU machine without Transformer Engine or apex;
# tests/parallel/test_tensor_parallel_training.py trains this layout
CPU_TORCHRUN_EXAMPLES = {
    "dmoe-train --nproc-per-node 4 parallel.tensor_model_parallel_size=2 "
    "parallel.sequence_parallel=true parallel.expert_model_parallel_size=2": 4,
}
# Synopses with placeholders, and the example that needs the user's own data files.
NOT_RUNNABLE = {
    "dmoe-train [CONFIG] [section.key=value ...] [--run-dir DIR] [--resume | --overwrite]",
    "dmoe-train CONFIG overrides... --run-dir DIR",
    "python -m megatron_dmoe ...",
    "dmoe-train --nproc-per-node 2 ...",
    "torchrun --nproc_per_node 2 -m megatron_dmoe ...",  # plain torchrun, which works too
    "dmoe-train --nproc-per-node",  # the launcher named in the text
    "dmoe-train my.yaml data.data_path=[data/corpus_text_document] data.tokenizer_model=tok.model",
    # GPT-2 BPE files and the time-to-quality corpus of the user's own (first lines of two-line commands)
    "dmoe-train my.yaml data.data_path=[data/gpt2_text_document] data.tokenizer_type=GPT2BPETokenizer \\",
    "dmoe-train zoo/dense_small data.data_path=[data/ttq/train_text_document] \\",
    "dmoe-train: warning: KEY: ...",  # the form of a warning, not a command
    # a synopsis; tests/training/test_upcycle.py runs upcycling
    "dmoe-train CONFIG checkpoint.upcycle_from=DENSE_RUN_DIR [moe.upcycle_granularity=N]",
    # the form of a resume hint (DIR a placeholder); tests/training/test_failure_lines.py checks the hints
    "dmoe-train --nproc-per-node 2 --run-dir DIR --resume",
    # an import of the user's own model; tests/inference/test_hf_import_families.py upcycles a tiny Llama
    "dmoe-train runs/llama/config.yaml --run-dir runs/llama-moe checkpoint.upcycle_from=runs/llama \\",
}


SWEEP_DRY_RUNS = {"dmoe-sweep configs/sweeps/tiny_topk_lr.yaml --dry-run",
                  "dmoe-sweep configs/sweeps/tiny_topk_lr.yaml training.train_iters=50 --dry-run"}
# what tests/launch/test_sweep_local.py and test_sweep_cli.py check on sweeps of their own
SWEEP_TESTED_ELSEWHERE = {
    "dmoe-sweep configs/sweeps/tiny_topk_lr.yaml",
    "dmoe-sweep configs/sweeps/xs_dmoe_vs_capacity.yaml --slurm",
    "dmoe-sweep --summary runs/tiny_topk_lr --plot loss.png",
    "dmoe-sweep configs/sweeps/time_to_quality.yaml",  # needs its corpus; its spec: test_sweep_spec.py
    # also its GPUs; --concurrent: test_sweep_local.py (stand-in runs), test_sweep_cli.py (errors)
    "dmoe-sweep configs/sweeps/time_to_quality.yaml --concurrent 4",
    # needs the corpus and CUDA; its plan: test_sweep_spec.py
    "dmoe-sweep configs/sweeps/settings_xs.yaml --concurrent 4",
    # the measured time-to-quality runs: the corpus and an H200 (80 GB is too little); plan: test_sweep_spec.py
    "dmoe-sweep configs/sweeps/time_to_quality_small_8min.yaml",
}
REPO = README.parent


def readme_commands(programs=("dmoe-train",)):
    """The commands of README.md that start with one of ``programs`` (dmoe-train also as
    `-m megatron_dmoe`), in code blocks and inline code."""
    text = README.read_text()
    pieces = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        pieces += [re.split(r"\s+#\s", line)[0] for line in block.splitlines()]
    # inline code with arguments (a bare `dmoe-sweep` in the text names the program)
    pieces += [p for p in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)) if " " in p]
    commands = set()
    for piece in pieces:
        piece = piece.split("&&")[-1].strip()
        if piece.startswith(programs) or ("dmoe-train" in programs
                                          and re.search(r"-m megatron_dmoe(\s|$)", piece)):
            commands.add(piece)
    return commands


def _dmoe_args(command):
    words = shlex.split(command)
    return words[words.index("megatron_dmoe") + 1:] if "megatron_dmoe" in words else words[1:]


def test_every_example_is_classified():
    assert readme_commands() == CPU_EXAMPLES | set(GPU_EXAMPLES) | set(CPU_TORCHRUN_EXAMPLES) | NOT_RUNNABLE
    assert readme_commands(("dmoe-sweep",)) == SWEEP_DRY_RUNS | SWEEP_TESTED_ELSEWHERE


@pytest.mark.parametrize("command", sorted(SWEEP_DRY_RUNS))
def test_sweep_dry_runs_run_as_written(command, monkeypatch, capsys):
    from megatron_dmoe.cli import sweep_main

    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository
    assert sweep_main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    assert "top_k=" in capsys.readouterr().out


def _without_run_dir(args):
    if "--run-dir" in args:
        i = args.index("--run-dir")
        return args[:i] + args[i + 2:]
    return args


def _cpu_runs():
    """Distinct CPU runs (the run directory aside) of the CPU and GPU examples."""
    runs = {}
    for command in sorted(CPU_EXAMPLES) + sorted(c for c, n in GPU_EXAMPLES.items() if n == 1):
        runs.setdefault(tuple(_without_run_dir(_dmoe_args(command))), command)
    return sorted(runs.values())


@pytest.mark.parametrize("command", _cpu_runs())
def test_runs_on_this_cpu(cli_run, tmp_path, corpus_cache, command):
    args = _without_run_dir(_dmoe_args(command))
    # a shortened run on the shared corpus: the zoo's 32000-token vocabulary would need its own
    shorter = small_args(corpus_cache, 2, "data.builtin_vocab_size=4096")
    result = cli_run(None, *args, *shorter, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stdout
    if command in GPU_EXAMPLES:
        assert "note: training.bf16: true needs CUDA; this CPU run trains in fp32" in result.stdout


@pytest.mark.parametrize("command", sorted(GPU_EXAMPLES))
def test_gpu_examples_are_valid_for_gpus(command):
    from megatron_dmoe.cli import parse_train_args

    ns, config, overrides = parse_train_args(_dmoe_args(command))
    assert (ns.nproc_per_node or 1) == GPU_EXAMPLES[command]
    if config is None:
        assert ns.resume, "without a CONFIG only a resume has a config (the run directory's)"
        config = "zoo/dmoe_small"  # the run this example continues
    validate(resolve(load_config(config, overrides)), world_size=GPU_EXAMPLES[command],
             env=Environment.everything())


@pytest.mark.parametrize("command", sorted(CPU_TORCHRUN_EXAMPLES))
def test_cpu_torchrun_examples_are_valid_on_a_bare_cpu(command):
    from megatron_dmoe.cli import parse_train_args

    ns, config, overrides = parse_train_args(_dmoe_args(command))
    assert ns.nproc_per_node == CPU_TORCHRUN_EXAMPLES[command]
    validate(resolve(load_config(config, overrides)), world_size=CPU_TORCHRUN_EXAMPLES[command],
             env=Environment(cuda=False, transformer_engine=False, apex=False))
