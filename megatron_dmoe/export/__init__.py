"""Export a trained run's model to other libraries' formats (transformers: hf.py)."""
