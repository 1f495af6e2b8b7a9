"""Tests of the suite itself; they run on CPU in CI."""

pytest_plugins = ["pytester"]
