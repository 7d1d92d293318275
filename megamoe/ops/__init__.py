"""Public functional API: validation and dispatch to kernels or references."""
