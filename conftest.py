"""Registers decodebench's pytest plugin and the fixtures of ``fixtures/``."""

pytest_plugins = [
    "decodebench.plugin",
    "decodebench.abplugin",
    "fixtures.device",
    "fixtures.process_group",
    "fixtures.attribution",
    "fixtures.expert_routing",
    "fixtures.vllm_server",
]
