"""Serving: the vLLM server process (``server``) and the streaming load client (``client``)."""
