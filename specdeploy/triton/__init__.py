"""Triton Inference Server integration: model repository writer, server launcher, gRPC client."""
