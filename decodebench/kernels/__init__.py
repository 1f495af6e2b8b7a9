"""Kernel adapters: one module per decode component, each with its torch reference
beside its vLLM adapter."""
