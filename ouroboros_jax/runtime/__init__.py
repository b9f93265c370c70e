"""Processes and hosts: `launch` (several processes, pinned), `distributed` (jax.distributed),
`host` (CPU device count and XLA flags, set before JAX starts)."""
