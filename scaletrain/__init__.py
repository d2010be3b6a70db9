"""scaletrain: DeepSpeed training for Hugging Face causal LMs."""
