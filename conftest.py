"""Registers decodebench's pytest plugin and the fixtures of ``fixtures/``."""

from fixtures import PLUGINS

pytest_plugins = list(PLUGINS)
