"""posttrain: LLM post-training recipes (SFT first) built on our own model definitions."""

__version__ = "0.1.0"
