"""Registers decodebench's pytest plugin and the fixtures of ``fixtures/``."""

pytest_plugins = [
    "decodebench.plugin",
    "decodebench.abplugin",
    "fixtures.device",
    "fixtures.procgroup",
    "fixtures.attribution",
    "fixtures.routing",
    "fixtures.server",
]
