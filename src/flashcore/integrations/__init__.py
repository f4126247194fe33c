"""Backends for other libraries, each imported on its own (``flashcore.integrations.transformers``)
so that ``import flashcore`` never imports them."""
