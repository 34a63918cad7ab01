"""specdeploy: speculative-decoding engine builder and deployment pipeline."""

__version__ = "0.1.0"
