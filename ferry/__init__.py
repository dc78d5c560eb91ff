"""ferry: carry LLM fine-tuning across an air gap."""
__version__ = "0.1.0"
