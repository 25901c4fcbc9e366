"""Apiary: federated averaging of PyTorch models across many GPU workers."""

__version__ = "0.1.0"
