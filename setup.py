"""Install megatron_dmoe, its block-sparse kernel library and its shipped configs.

Three import names come from this repository:
  megatron_dmoe          the package users import (megatron_dmoe/)
  dmoe_kernels           the standalone block-sparse kernel library (the kernels/ folder)
  megatron_dmoe_configs  the shipped YAML experiments (the configs/ folder)
The kernel library is not importable as ``kernels``: a different package of that name exists on the
package registry, and a top-level ``kernels`` would shadow it or be shadowed by it.
"""
from setuptools import find_packages, setup

kernel_packages = ["dmoe_kernels"] + [
    "dmoe_kernels." + p for p in find_packages("kernels")
]

setup(
    name="megatron-dmoe",
    version="0.1.0",
    description="Dropless Mixture-of-Experts training on megatron-core with block-sparse Triton kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dmoe", "megatron_dmoe.*"])
    + kernel_packages
    + ["megatron_dmoe_configs"],
    package_dir={"dmoe_kernels": "kernels", "megatron_dmoe_configs": "configs"},
    package_data={"megatron_dmoe_configs": ["*.yaml", "*/*.yaml", "*/*/*.yaml"]},
    install_requires=[
        "torch>=2.5,<3",
        "megatron-core>=0.16,<0.20",
        # Triton ships Linux wheels only; elsewhere the reference and grouped backends run.
        "triton>=3.6; platform_system == 'Linux'",
        "numpy>=1.24",
        "sentencepiece>=0.2",
        "pyyaml>=6",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        # megatron-core's dist_checkpointing needs psutil but does not declare it.
        "psutil>=5.9",
    ],
    extras_require={
        # data.tokenizer_type GPT2BPETokenizer / HuggingFaceTokenizer go through transformers
        "tokenizers": ["transformers>=4.40"],
        # data.tokenizer_type TikTokenizer reads a tiktoken vocabulary
        "tiktoken": ["tiktoken>=0.7"],
        # dmoe-export --format hf writes safetensors; training never needs it
        "hf": ["safetensors>=0.4"],
        # logging.wandb_project (--wandb-project): Weights & Biases logging
        "wandb": ["wandb>=0.17"],
        # wandb: the W&B test writes an offline run and reads its scalars back
        "test": ["pytest>=8", "pytest-timeout>=2.2", "transformers>=5.0", "safetensors>=0.4", "ruff>=0.17,<0.18",
                 "wandb>=0.17"],
    },
    entry_points={
        "console_scripts": [
            "dmoe-train=megatron_dmoe.cli:main",
            "dmoe-sweep=megatron_dmoe.cli:sweep_main",
            "dmoe-eval=megatron_dmoe.inference.eval_cli:main",
            "dmoe-generate=megatron_dmoe.inference.generate_cli:main",
            "dmoe-export=megatron_dmoe.export.cli:main",
            "dmoe-import=megatron_dmoe.hf_import.cli:main",
        ],
    },
)
