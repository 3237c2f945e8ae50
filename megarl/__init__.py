"""megarl: a Megatron-based, asynchronous RL trainer for LLMs (LlamaRL recipe)."""

__version__ = "0.1.0"
