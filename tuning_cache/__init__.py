"""Shipped, read-only tuning tables (one YAML per device); installed as `gdr_dispatch.tuning_cache`."""
