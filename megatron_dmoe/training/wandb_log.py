"""Weights & Biases logging (logging.wandb_*, Megatron-LM's --wandb-project, --wandb-exp-name,
--wandb-save-dir): rank 0 sends every logged step's scalars, as TensorBoard gets them, to one W&B
run. wandb is optional (`pip install -e ".[wandb]"`); validation refuses the keys without it, so it
is imported only here, when a run starts."""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_dmoe.config import RunConfig
from megatron_dmoe.training.run_dir import WANDB_DIR


@dataclass
class WandbSettings:
    project: str
    name: str
    save_dir: Path
    mode: Optional[str]  # online | offline; None = wandb's own choice (WANDB_MODE, else online)
    config: Dict[str, Any]  # the resolved run config, shown with the W&B run

    def start(self, start_step: int):
        """The W&B run (wandb's Run: log(dict, step=...), finish()). A resumed run (start_step > 0)
        continues the same W&B run: its id is the run directory's name."""
        import wandb

        self.save_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(project=self.project, name=self.name, dir=str(self.save_dir), mode=self.mode,
                          config=self.config, id=_run_id(self.save_dir), resume="allow" if start_step else None)


def wandb_settings(cfg: RunConfig, run_dir: Path) -> Optional[WandbSettings]:
    """The run's W&B settings; None when logging.wandb_project is not set."""
    lg = cfg.logging
    if not lg.wandb_project:
        return None
    return WandbSettings(project=lg.wandb_project, name=lg.wandb_exp_name or Path(run_dir).resolve().name,
                         save_dir=Path(lg.wandb_save_dir) if lg.wandb_save_dir else Path(run_dir) / WANDB_DIR,
                         mode=lg.wandb_mode, config=dataclasses.asdict(cfg))


def _run_id(save_dir: Path) -> str:
    """One W&B run id per save directory, kept in it: a resumed run logs into the same W&B run."""
    path = save_dir / "run_id"
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # W&B's ids: short, lower-case letters and digits
    path.write_text(run_id + "\n")
    return run_id
