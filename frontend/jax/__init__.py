"""JAX frontend: jaxpr capture to the IR (``capture``) and NamedSharding/jit emission (``emit``).

Kept import-light: jax loads only when a submodule is imported.
"""
