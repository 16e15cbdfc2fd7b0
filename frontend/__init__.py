"""Frontends: capture a torch or JAX training step as IR, and emit plans back to it.

Import-light: importing this package registers the emitters behind ``Plan.apply`` /
``Plan.jit`` (``emitters.py``) and imports neither torch nor jax.
"""

from . import emitters as emitters
