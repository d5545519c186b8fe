"""CUDA running out of memory during training is one line: what torch tried to allocate, what the
card holds, and the settings that lower the peak; never a traceback."""
import torch

from megatron_dmoe import cli
from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.training import loop
from megatron_dmoe.training.out_of_memory import out_of_memory_message

TORCH_TEXT = ("CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
              "142.62 MiB is free. Including non-PyTorch memory, this process has 78.33 GiB memory in use.")


def test_the_message_names_the_sizes_and_the_settings_that_fit():
    cfg = resolve(load_config("zoo/dmoe_small"))
    message = out_of_memory_message(torch.OutOfMemoryError(TORCH_TEXT), cfg)
    assert "tried to allocate 1.95 GiB; the GPU holds 79.18 GiB" in message
    assert f"training.micro_batch_size (now {cfg.training.micro_batch_size};" in message
    assert "moe.memory_optimized: true" in message and "training.recompute_granularity" in message
    assert "training.cuda_graphs: false (now auto;" in message
    assert "--resume" in message and "\n" not in message
    # a dense model with every memory setting already taken is told what is left
    dense = resolve(load_config("zoo/dense_small", ["training.micro_batch_size=1", "training.global_batch_size=8",
                                                    "training.recompute_granularity=full",
                                                    "training.cuda_graphs=false"]))
    left = out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory."), dense)
    assert "no size reported" in left and "more memory" in left and "micro_batch_size" not in left


def test_dmoe_train_reports_out_of_memory_in_one_line(monkeypatch, tmp_path, capsys, corpus_cache):
    from train_helpers import small_args

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(TORCH_TEXT)

    monkeypatch.setattr(loop, "train", out_of_memory)
    code = cli.train_main(["--run-dir", str(tmp_path / "run"), *small_args(corpus_cache, 1)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("dmoe-train: error: CUDA ran out of memory during training (tried to allocate 1.95 GiB")
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
