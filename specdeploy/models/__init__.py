"""Model families: one module per architecture, registered by name in registry.py."""
