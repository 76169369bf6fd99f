"""Triton kernels, their launchers and autograd functions: one module per kernel family."""
