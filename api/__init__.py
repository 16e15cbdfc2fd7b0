"""The public entry points (``sp.plan``, ``sp.evaluate``, ``sp.whatif``, the recsys and
torchtitan front doors) and their argument checks: the layer above the frontends, below the CLI."""
