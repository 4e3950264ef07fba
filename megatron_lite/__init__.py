"""megatron_lite: Megatron-style LLM pretraining."""
