"""What the backends share: pipelines and checks, never a backend (nothing here registers)."""
