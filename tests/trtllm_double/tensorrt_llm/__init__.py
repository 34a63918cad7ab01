"""Test double of TensorRT-LLM's Python API (see the README beside it)."""
