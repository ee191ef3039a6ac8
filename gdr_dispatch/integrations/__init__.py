"""Hooks that make other libraries' models call gdr_dispatch's ops (`integrations.transformers`)."""
