"""Serving: a vLLM server (``server``, ``process``, ``config``, ``logs``, ``handle``) and the
streaming decode load against it (``client``, ``load``, ``stream``, ``metrics``)."""
