"""JAX frontend: jaxpr capture to the IR (``capture``) and NamedSharding/jit emission (``emit``).

Kept import-light: jax loads only when a submodule is imported.
"""


def __getattr__(name: str):
    """``from shardplan.frontend.jax import make_jax_mesh`` without importing jax up front."""
    if name == "make_jax_mesh":
        from .emit import make_jax_mesh

        return make_jax_mesh
    raise AttributeError(name)
